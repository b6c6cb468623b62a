"""A job of writer processes for tests of ckpt/commit/through_storage.py,
on a disk or a bucket.

A step is first saved by a real Checkpointer into a scratch directory on
the local disk; its files are then split among N writer processes
(tests/commit/through_storage_worker.py) by leaf, each array to one
process, so that each process's tiling digest is that of the arrays it
wrote and their sum covers every array once. The attempt they write into
is prepared as a trainer's process 0 prepares one
(ckpt/commit/protocol.py ``prepare``); process 0's writer commits the
scratch step's own index. Restoring the step through the normal
Checkpointer then gives back the state saved, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import subprocess
import sys

import numpy as np

import ckpt
from ckpt.commit import protocol as commit_lib
from ckpt.format import index as index_lib
from ckpt.format import pack_index
from ckpt.shards import tiling
from ckpt.store import names
from ckpt.store import storage as storage_lib
from tests.conftest import random_array

_SKIPPED = {names.INDEX_NAME, names.COMMIT_MARKER, "attempt.json"}
_PROCESS_KINDS = (index_lib.HOST_STATE_DIR, index_lib.CHECKSUMS_DIR)


def state(rng, leaves: int = 4) -> dict:
  """Kernels large enough to be stored each as an array of its own (over
  ckpt/save/pack.py's 64 KiB), small biases packed."""
  return {f"layer_{i}": {"w": random_array(rng, (96, 200 + i)),
                         "b": random_array(rng, (96,), np.int32)}
          for i in range(leaves)}


@dataclasses.dataclass
class Source:
  """A step saved by a Checkpointer, split among writers."""
  step_dir: str
  index: bytes
  arrays: list[tuple[str, tuple[int, ...]]]  # (relpath, shape)
  packed: set[str]  # the relpaths of arrays stored in the packs
  files: list[str]  # data files (relative)


def saved(tmp_path, st: dict) -> Source:
  scratch = tmp_path / "scratch"
  c = ckpt.Checkpointer(scratch, async_save=False)
  try:
    assert c.save(1, st)
  finally:
    c.close()
  step_dir = os.fspath(scratch / names.step_dirname(1))
  with open(os.path.join(step_dir, names.INDEX_NAME), "rb") as f:
    data = f.read()
  idx = index_lib.decode(data)
  arrays = [(e.relpath, tuple(e.shape)) for e in idx.leaves
            if hasattr(e, "relpath")]
  packed = {e.relpath for e in idx.leaves
            if isinstance(e, pack_index.PackedEntry)}
  files = sorted(os.path.relpath(os.path.join(d, n), step_dir)
                 for d, _, ns in os.walk(step_dir) for n in ns
                 if os.path.relpath(os.path.join(d, n), step_dir)
                 not in _SKIPPED)
  return Source(step_dir, data, arrays, packed, files)


@dataclasses.dataclass
class Job:
  """N writers of one attempt at ``step`` of the root ``url``."""
  url: str
  source: Source
  processes: int
  step: int = 7
  token: str = dataclasses.field(
      default_factory=lambda: secrets.token_hex(8))
  bound_s: float = 60.0
  lease_s: float = 30.0

  def index(self) -> bytes:
    """The source's index, saying this job's step."""
    return index_lib.encode(dataclasses.replace(
        index_lib.decode(self.source.index), step=self.step))

  def prepare(self) -> str:
    """What process 0's trainer does before anyone writes."""
    return commit_lib.prepare(storage_lib.Storage(self.url), self.step,
                              self.token, self.lease_s)

  def owners(self) -> dict[str, int]:
    """Which process writes each array: the arrays of their own round
    the processes, the packed ones process 0 (which copies the packs)."""
    alone = [r for r, _ in self.source.arrays if r not in self.source.packed]
    return {**{r: 0 for r in self.source.packed},
            **{r: i % self.processes for i, r in enumerate(alone)}}

  def share(self, p: int) -> tuple[list[str], list[str], list[int]]:
    """(files to copy, per-process files, tiling digest) of process p."""
    own = self.owners()
    mine = [r for r, _ in self.source.arrays if own[r] == p]
    boxes = [(r, s, (0,) * len(s), s) for r, s in self.source.arrays
             if own[r] == p]
    copy, own = [], []
    for rel in self.source.files:
      head = rel.split("/", 1)[0]
      if head in _PROCESS_KINDS:
        if p == 0:
          own.append(rel)
      elif any(rel.startswith(r + "/") for r in mine):
        copy.append(rel)
      elif p == 0 and not any(rel.startswith(r + "/")
                              for r, _ in self.source.arrays):
        copy.append(rel)  # beside every array (none in zarr3 today)
    return copy, own, list(tiling.digest(boxes))

  def start(self, tmp_path, p: int, *, commit: bool | None = None,
            hold: bool = False, kill_at: str | None = None,
            error: str | None = None, env: dict | None = None,
            bound_s: float | None = None) -> subprocess.Popen:
    copy, own, digest = self.share(p)
    index_path = tmp_path / f"index-{self.token}"
    index_path.write_bytes(self.index())
    job = {"url": self.url, "step": self.step, "token": self.token,
           "process": p, "processes": self.processes,
           "src": self.source.step_dir, "copy": copy, "own": own,
           "tiling": digest, "error": error, "hold": hold,
           "commit": p == 0 if commit is None else commit,
           "kill_at": kill_at,
           "bound_s": self.bound_s if bound_s is None else bound_s,
           "lease_s": self.lease_s, "index": os.fspath(index_path),
           "whole": list(tiling.whole(self.source.arrays))}
    path = tmp_path / f"job-{self.token}-{p}.json"
    path.write_text(json.dumps(job))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.commit.through_storage_worker",
         os.fspath(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu",
                 **(env or {})))


def outcome(proc: subprocess.Popen, timeout_s: float = 120) -> dict:
  """The writer's last line (its outcome), once it exited 0."""
  out, _ = proc.communicate(timeout=timeout_s)
  assert proc.returncode == 0, (proc.returncode, out)
  return json.loads(out.strip().splitlines()[-1])


def expect_line(proc: subprocess.Popen, line: str) -> None:
  got = proc.stdout.readline().strip()
  assert got == line, (got, line)


def assert_same(got, want) -> None:
  """Every leaf bit for bit."""
  assert sorted(got) == sorted(want)
  for k, v in want.items():
    if isinstance(v, dict):
      assert_same(got[k], v)
    else:
      g = np.asarray(got[k])
      assert g.dtype == v.dtype and g.shape == v.shape
      assert g.tobytes() == v.tobytes(), k


def write_share(job: Job, p: int, error: str | None = None) -> None:
  """Process p's share and record, written from this process (for tests
  where process 0's writer is the test itself)."""
  from ckpt.commit import strategy  # pylint: disable=g-import-not-at-top
  from ckpt.commit import through_storage  # pylint: disable=g-import-not-at-top
  from tests.commit import through_storage_worker as worker  # pylint: disable=g-import-not-at-top
  st = storage_lib.Storage(job.url)
  work = strategy.for_storage(st).work_dir(job.step, job.token)
  copy, own, digest = job.share(p)
  for rel in copy:
    worker.copy_file(st, work, job.source.step_dir, rel)
  files = {rel: worker.copy_file(st, work, job.source.step_dir, rel)
           for rel in own}
  through_storage.write_record(st, job.step, job.token, p, job.processes,
                               files=files, tiling=digest, error=error)
