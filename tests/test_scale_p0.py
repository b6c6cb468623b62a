"""Process 0's per-process work in a save, at 1,024 and 4,096 processes,
fed synthetic per-process records (scripts/scale_p0.py; no processes).

The save round's posts of N processes (each with the digest of the boxes
it plans to write) and the commit of a step directory holding N processes'
files, on process 0's real code: its CPU per process stays a few
microseconds at any N (what grows with N on process 0 is the coordination
service's answers to the other processes' calls, which docs/at-scale.md
models from a real job's figures), and a tiling that one process got wrong
is refused in the round, before anything is written.
"""

import json

import pytest

from ckpt.multihost import agreement
from scripts import scale_p0

# CPU per process of process 0's Python work (round + commit); measured 8-16
# us on the shared 2-core machine at load 18: a bound with room for load,
# far below what a per-process request or file read would cost.
PER_PROCESS_US = 100.0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [1024, 4096])
def test_process_0_pays_microseconds_per_process(tmp_path, n):
  round_s = scale_p0.round_cpu_s(n)
  commit_s = scale_p0.commit_cpu_s(n, str(tmp_path), repeat=1)
  per_us = 1e6 * (round_s + commit_s) / n
  print(f"N={n}: round {round_s:.4f} s, commit {commit_s:.4f} s of CPU, "
        f"{per_us:.1f} us per process")
  assert per_us < PER_PROCESS_US, (round_s, commit_s)


def test_a_wrong_tiling_is_refused_in_the_round():
  posts, whole, values = scale_p0._posts(1024)  # pylint: disable=protected-access
  bad = json.loads(posts[17])
  bad["tiling"][0] += 1  # process 17 plans one element more
  posts[17] = json.dumps(bad)
  with scale_p0._fed(posts):  # pylint: disable=protected-access
    with pytest.raises(Exception, match="exactly once") as e:
      agreement.save_round("k", 7, None, values, lambda: "0123456789ab",
                           timeout_s=60,
                           tiling=(json.loads(posts[0])["tiling"], whole))
  assert "refused before anything was written" in str(e.value)
  assert "1024 processes" in str(e.value)
