"""One host's writer in tests/commit/test_through_storage.py: a plain
process (never ``jax.distributed``: no coordination service is alive) that
writes its share of a step into an attempt, then its record; process 0's
writer also holds the lease and commits (ckpt/commit/through_storage.py).

Run as ``python -m tests.commit.through_storage_worker <job.json>``; the job
(written by ``tests.commit.writers.Job``) says what to copy from a step saved
beforehand. Lines on stdout: ``ready`` when told to wait before its record
(``hold``: then it reads stdin, where the test SIGKILLs it),
``committing`` when told to stop inside the commit (``kill_at``), and last
one JSON line: the outcome.
"""

from __future__ import annotations

import json
import os
import sys

from ckpt.commit import records
from ckpt.commit import rename
from ckpt.commit import strategy
from ckpt.commit import through_storage as ts_commit
from ckpt.commit.marker import MarkerCommit
from ckpt.errors import CheckpointError
from ckpt.store import storage as storage_lib


def _stop_here(*args, **kwargs):
  """Says so and waits to be SIGKILLed (stdin stays open until then)."""
  del args, kwargs
  print("committing", flush=True)
  sys.stdin.read()
  raise SystemExit("the test never killed this writer")


def _kill_points(kill_at: str | None) -> None:
  """Stops the commit at a known line (this process only)."""
  if kill_at == "before rename":  # index and marker in the attempt, not renamed
    rename.fsync_dir = _stop_here
  elif kill_at == "after marker":  # bucket: marker written, no record yet
    records.record = _stop_here
  elif kill_at == "after record":  # bucket: the record written: committed
    MarkerCommit._still_whole = _stop_here  # pylint: disable=protected-access
  elif kill_at is not None:
    raise ValueError(kill_at)


def copy_file(st: storage_lib.Storage, work: str, src: str, rel: str) -> bytes:
  with open(os.path.join(src, rel), "rb") as f:
    data = f.read()
  if st.is_posix:
    path = os.path.join(os.fspath(st.root), work, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    storage_lib.write_file(path, data)
  else:
    st.write_bytes(f"{work}/{rel}", data)
  return data


def main(job_path: str) -> None:
  with open(job_path) as f:
    job = json.load(f)
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  assert distributed.global_state.client is None  # no coordination service
  st = storage_lib.Storage(job["url"])
  step, token, p, n = job["step"], job["token"], job["process"], job["processes"]
  work = strategy.for_storage(st).work_dir(step, token)
  renewal = (ts_commit.hold_lease(st, step, token, job["lease_s"])
             if p == 0 and job["commit"] else None)
  for rel in job["copy"]:
    copy_file(st, work, job["src"], rel)
  own = {rel: copy_file(st, work, job["src"], rel) for rel in job["own"]}
  if job["hold"]:
    print("ready", flush=True)
    sys.stdin.read()
  ts_commit.write_record(st, step, token, p, n, files=own,
                         tiling=job["tiling"], error=job["error"])
  out = {"process": p, "pid": os.getpid()}
  try:
    if job["commit"]:
      _kill_points(job["kill_at"])
      with open(job["index"], "rb") as f:
        index = f.read()
      ts_commit.commit_when_written(st, step, token, n, index,
                                    bound_s=job["bound_s"], renewal=renewal,
                                    whole=job["whole"])
      out["committed"] = True
    else:
      out["committed"] = ts_commit.wait_committed(st, step, token,
                                                  job["bound_s"])
  except CheckpointError as e:
    out.update(committed=False, error=type(e).__name__, message=str(e))
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
