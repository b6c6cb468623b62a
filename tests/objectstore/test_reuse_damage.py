"""reuse_unchanged=True on a bucket (moto S3, the GCS emulator) never costs
the redundancy of keep=N (ckpt/save/reuse.py, reuse_source.py): before a
leaf is held again, each of its chunk objects must still have the storage
generation recorded when it was written, so an object deleted (an
operator, a lifecycle rule) or overwritten is never held by a new step,
and two consecutive steps hold two copies of every leaf."""

from __future__ import annotations

import numpy as np
import pytest

import ckpt
from ckpt.cli import integrity
from ckpt.commit import steps as steps_lib
from ckpt.restore import read as read_lib
from ckpt.store import storage as storage_lib

CHUNK = 64 << 10


def _frozen() -> np.ndarray:
  return np.random.default_rng(99).standard_normal((512, 256), np.float32)


def _state(step: int) -> dict:
  return {"frozen": _frozen(),
          "train": np.random.default_rng(step).standard_normal(
              (256, 256), np.float32),
          "step": step}


def _holder(url: str, step: int) -> tuple[int, str]:
  """The (step, data directory) whose objects step ``step``'s frozen leaf
  is read from."""
  s = storage_lib.Storage(url)
  where = steps_lib.step_dir(s, step)
  index = read_lib.read_index(s, where)
  entry = next(e for e in index.leaves if e.relpath == "frozen")
  if entry.held_by is not None:
    return tuple(entry.held_by)
  step_name, data_dir = where.split("/")
  return int(step_name.split("_")[1]), data_dir


def _restores_exactly(url: str) -> int:
  with ckpt.Checkpointer(url) as c:
    got = c.restore()
  want = _state(int(got["step"]))
  for k in ("frozen", "train"):
    assert np.asarray(got[k]).tobytes() == want[k].tobytes(), k
  return int(got["step"])


@pytest.mark.parametrize("how", ["deleted", "overwritten", "no metadata"])
@pytest.mark.parametrize("bucket", ["s3_bucket", "gs_bucket"])
def test_a_holder_object_deleted_or_overwritten_is_never_held_again(
    bucket, how, request):
  """Issue 44, item 1: the object of the holder the next save would hold
  is deleted or overwritten while the job runs; saves 4 and 5 (keep=2)
  succeed, neither kept step refers to the damaged holder, and a restarted
  job restores step 5 bit-exact."""
  url = request.getfixturevalue(bucket) + "/run"
  with ckpt.Checkpointer(url, reuse_unchanged=True, keep=2,
                         async_save=False, chunk_bytes=CHUNK) as c:
    for step in range(4):
      c.save(step, _state(step))
    damaged = _holder(url, 2)  # the copy save 4 would hold
    s = storage_lib.Storage(url)
    key = f"checkpoint_{damaged[0]}/{damaged[1]}/frozen/0.0"
    if how == "deleted":
      s.delete_key(key)
    elif how == "no metadata":
      s.delete_key(key.replace("/0.0", "/.zarray"))
    else:
      data = bytearray(s.read_bytes(key))
      data[100] ^= 1
      s.write_bytes(key, bytes(data))
    for step in (4, 5):
      c.save(step, _state(step))
    assert c.all_steps() == [4, 5]
  holders = {_holder(url, step) for step in (4, 5)}
  assert damaged not in holders and len(holders) == 2
  for step in (4, 5):
    assert integrity.verify(url, step=step) == []
  assert _restores_exactly(url) == 5


def test_keep_2_spans_two_copies_on_a_bucket(s3_bucket):
  """No damage in flight: the two kept steps hold two copies, so losing
  the newest step's holder object leaves the other step restorable."""
  url = s3_bucket + "/run"
  with ckpt.Checkpointer(url, reuse_unchanged=True, keep=2,
                         async_save=False, chunk_bytes=CHUNK) as c:
    for step in range(5):
      c.save(step, _state(step))
  newest = _holder(url, 4)
  assert newest != _holder(url, 3)
  storage_lib.Storage(url).delete_key(
      f"checkpoint_{newest[0]}/{newest[1]}/frozen/0.0")
  assert _restores_exactly(url) == 3
