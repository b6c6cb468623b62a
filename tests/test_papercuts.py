"""Issue 45 item 8, the papercuts with behaviour: a misspelt top-level key
of a restore target gets a "did you mean", and the error of a save called
on one process only says why a process waits ``barrier_timeout_s`` (600 s
by default) before it (a real 2-process job). The README's list of pages
(tests/test_readme.py), a CPU multi-process example (docs/multi-host.md,
run by tests/test_docs.py) and docs/reference.md outside the site
(tests/test_reference_page.py) are checked where those pages are."""

from __future__ import annotations

import numpy as np
import pytest

import ckpt
from ckpt.multihost import local_cluster
from tests.multiprocess import launch


def test_a_misspelt_top_level_key_gets_a_did_you_mean(tmp_path):
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(1, {"params": {"w": np.ones(4)}, "opt_state": {"mu": np.ones(4)}})
    with pytest.raises(ckpt.MissingLeavesError,
                       match=r"Did you mean 'params' for the target's "
                       r"'parms' \(a top-level key\)\?"):
      c.restore(1, target={"parms": {"w": np.zeros(4)},
                           "opt_state": {"mu": np.zeros(4)}})


def test_a_save_on_one_process_says_why_it_waited(tmp_path):
  (p0, p1) = local_cluster.check(local_cluster.run(
      "tests.multiprocess.onesided_worker", {"dir": str(tmp_path)},
      num_processes=2, devices_per_process=1, timeout_s=launch.TIMEOUT_S,
      cwd=str(launch.REPO)))
  assert p1["error"] is None
  err = p0["error"]
  assert err is not None and err["type"] == "BarrierTimeoutError", p0
  assert "processes that did not arrive: [1]" in err["msg"], err["msg"]
  assert ("barrier_timeout_s, 600 s by default, is how long a process "
          "waits for the others") in err["msg"], err["msg"]
  assert "smaller barrier_timeout_s" in err["msg"], err["msg"]
  assert p0["seconds"] < 30, p0
