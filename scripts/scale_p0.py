"""What process 0 does per process in a save, modelled at any process count.

Process 0 of a job of N processes does, per save, some work for each
process (the rest of its save is the same at every N):

- in the save round (ckpt/multihost/agreement.py ``save_round``): it parses
  the N posts (in a later save the ones it holds from the last:
  ``PostMemory``) (one JSON each: failure, host-value digests, host_state
  claim, the digest of the boxes the process plans to write), compares the
  host digests with its own and adds up the tiling digests;
- in the commit (ckpt/commit/rename.py ``publish``): it fsyncs every
  directory of the step, listing the per-process files of N processes
  (``.packs/<p>.*``, ``.checksums/<p>.msgpack``);
- the coordination service it runs answers every call of every process:
  per later save, a process other than 0 makes ``CALLS_PER_SAVE`` calls.

``python -m scripts.scale_p0 [--processes 1024 4096]`` runs the first two
for real on synthetic per-process records (no processes: the round's
``multihost.agree`` is fed N posts such as N processes send; the commit is
the real one of a step directory holding N processes' files, on local
disk) and prints process 0's CPU seconds, with the service's share modelled
from ``--barrier-us`` and ``--kv-us`` (CPU that process 0 spends per
process on one barrier arrival and one key-value call: measured on the
2-core machine by scripts/scale_jobs.py runs, see docs/at-scale.md). The
4 and 32 process figures of a real job are ``python -m scripts.scale
--config configs/scale_p0.json --part jobs``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from ckpt.multihost import agreement
from ckpt.multihost import process as multihost
from ckpt.shards import tiling

# The calls a process other than 0 makes per later save into the service
# process 0 runs (ckpt/save/outcome.py, agreement.save_round): the round (a
# barrier and a blocking get; its post, a set, only when it differs from
# the one process 0 holds from the last save: agreement.PostMemory), the
# barrier "written" and a blocking get of the outcome.
CALLS_PER_SAVE = {"barrier": 2, "kv": 2}
# The host values of the mixed tree of scripts/scale_jobs.py (inline values
# and host numpy leaves every process must hold alike).
HOST_VALUES = 13


def _posts(n: int) -> tuple[dict[int, str], Any, list]:
  """N processes' posts of a save round of a healthy save, the whole
  tiling digest, and process 0's host values."""
  values = [(f"mixed/v{i}", 1000 + i) for i in range(HOST_VALUES)]
  host = agreement.digests(values)
  rows = 32 * n  # one (rows, 64) array, a block of rows per process
  whole = tiling.whole([("layer_0/w0", (rows, 64))])
  posts = {}
  for p in range(n):
    mine = tiling.digest([("layer_0/w0", (rows, 64), (32 * p, 0),
                           (32 * p + 32, 64))])
    posts[p] = json.dumps({"error": None, "host": host,
                           "hs": ["own", False], "tiling": list(mine)})
  return posts, whole, values


@contextlib.contextmanager
def _fed(posts: dict[int, str], count: int | None = None):
  """``multihost.agree`` as process 0 runs it, fed ``posts``: the
  directory listing the service returns parsed (``_by_process``), then
  ``decide``; ``count``: the processes of the job (default: the posts)."""
  real, real_count = multihost.agree, multihost.process_count
  items = [(f"ckpt/x/save/7/0/start/in/{p}", v) for p, v in posts.items()]
  n = len(posts) if count is None else count

  def agree(key, post, decide, **kw):
    del key, post, kw
    return decide(multihost._by_process(items))  # pylint: disable=protected-access

  multihost.agree, multihost.process_count = agree, lambda: n
  try:
    yield
  finally:
    multihost.agree, multihost.process_count = real, real_count


def round_cpu_s(n: int, repeat: int = 3, later: bool = False) -> float:
  """Process 0's CPU seconds in the save round of N processes (best of
  ``repeat``). ``later``: a later save's round, in which no process posts
  (each post is the one process 0 holds from the last save:
  agreement.PostMemory)."""
  posts, whole, values = _posts(n)
  mine = json.loads(posts[0])["tiling"]
  best = float("inf")
  with _fed({} if later else posts, n):
    for _ in range(repeat):
      if later:
        agreement._memory.posts["model"] = dict(posts)  # pylint: disable=protected-access
      t = time.process_time()
      d = agreement.save_round("k", 7, None, values, lambda: "0123456789ab",
                               timeout_s=60, tiling=(mine, whole),
                               memory="model" if later else None)
      best = min(best, time.process_time() - t)
      if d.action != "save":
        raise AssertionError(f"the model's round did not decide to save: {d}")
  return best


def commit_cpu_s(n: int, base: str, repeat: int = 2) -> float:
  """Process 0's CPU seconds committing a step whose directory holds N
  processes' files (a pack, a pack table, a checksum file each) on local
  disk (best of ``repeat``): ckpt/commit/protocol.py ``commit``."""
  from ckpt.commit import protocol as commit_lib  # pylint: disable=g-import-not-at-top
  from ckpt.store import storage as storage_lib  # pylint: disable=g-import-not-at-top
  root = os.path.join(base, f"root{n}")
  storage = storage_lib.Storage(root)
  best = float("inf")
  for step in range(repeat):
    token = f"{step:012x}"
    rel = commit_lib.prepare(storage, step, token)
    work = os.path.join(root, rel)
    for sub in (".packs", ".checksums"):
      os.mkdir(os.path.join(work, sub))
    for p in range(n):
      for name in (f".packs/{p}.0.bin", f".packs/{p}.msgpack",
                   f".checksums/{p}.msgpack"):
        with open(os.path.join(work, name), "wb") as f:
          f.write(b"x")
    t = time.process_time()
    commit_lib.commit(storage, step, token, b"index")
    best = min(best, time.process_time() - t)
  shutil.rmtree(root, ignore_errors=True)
  return best


def service_cpu_s(n: int, barrier_us: float, kv_us: float) -> float:
  """The service's CPU on process 0 for the calls of N - 1 processes."""
  per = (CALLS_PER_SAVE["barrier"] * barrier_us
         + CALLS_PER_SAVE["kv"] * kv_us) * 1e-6
  return (n - 1) * per


def model(counts, barrier_us: float, kv_us: float) -> list[dict]:
  rows = []
  base = tempfile.mkdtemp(prefix="ckpt-scale-p0-")
  try:
    for n in counts:
      r, c = round_cpu_s(n, later=True), commit_cpu_s(n, base)
      s = service_cpu_s(n, barrier_us, kv_us)
      rows.append({"processes": n, "round_cpu_s": r, "commit_cpu_s": c,
                   "python_per_process_us": 1e6 * (r + c) / n,
                   "service_cpu_s": s, "total_cpu_s": r + c + s})
  finally:
    shutil.rmtree(base, ignore_errors=True)
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=int, nargs="+",
                      default=[4, 32, 1024, 4096])
  parser.add_argument("--barrier-us", type=float, default=90.0)
  parser.add_argument("--kv-us", type=float, default=220.0)
  args = parser.parse_args(argv)
  print("| N | round CPU s | commit CPU s | Python us/process | service CPU s "
        "(modelled) | process 0 per-process CPU s/save |")
  print("|---:|---:|---:|---:|---:|---:|")
  for r in model(args.processes, args.barrier_us, args.kv_us):
    print(f"| {r['processes']} | {r['round_cpu_s']:.4f} | "
          f"{r['commit_cpu_s']:.4f} | {r['python_per_process_us']:.1f} | "
          f"{r['service_cpu_s']:.3f} | {r['total_cpu_s']:.3f} |")
  load = os.getloadavg()
  print(f"\n(load average {load[0]:.1f} on {os.cpu_count()} cores; service "
        f"{args.barrier_us:g} us a barrier, {args.kv_us:g} us a key-value "
        f"call, {CALLS_PER_SAVE} per process per save)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
