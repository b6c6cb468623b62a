"""Temporary steps and root metadata on a bucket (moto S3): the temporary
mark travels in the step's commit record (the one GET retention reads per
step there), a restarted job's retention deletes a temporary step of the
run before it, and the root metadata survives every step's deletion."""

from __future__ import annotations

import numpy as np

import ckpt
from ckpt.commit import records
from ckpt.store import storage as storage_lib


def _state(step: int) -> dict:
  return {"w": np.full(64, step, np.float32)}


class Clock:
  def __init__(self):
    self.t = 1_700_000_000.0

  def __call__(self) -> float:
    return self.t


def test_temporary_steps_and_root_metadata_on_s3(s3_bucket):
  url = f"{s3_bucket}/policies"
  clock = Clock()
  kw = dict(save_on_steps=[0, 10], save_interval_secs=5,
            temporary_time_saves=True, clock=clock, keep=1,
            custom_metadata={"run": "r1"})
  with ckpt.Checkpointer(url, **kw) as c:
    assert c.save(0, _state(0))
    clock.t += 5
    assert c.save(3, _state(3))  # by time: temporary
    c.wait_until_finished()
    assert c.all_steps() == [0, 3]
  storage = storage_lib.Storage(url)
  assert records.read_record(storage, 3)["temporary"] is True
  assert records.read_record(storage, 0)["temporary"] is False
  assert records.read_info(storage, 3)[2] is True
  # A restarted job: its first save deletes the temporary step 3 (and,
  # keep=1, step 0); the root metadata stays.
  with ckpt.Checkpointer(url, **kw) as c:
    assert c.save(10, _state(10))
    c.wait_until_finished()
    assert c.all_steps() == [10]
    assert c.root_metadata().custom_metadata == {"run": "r1"}
  with ckpt.Checkpointer(url) as reader:
    assert reader.root_metadata().custom_metadata == {"run": "r1"}
    assert reader.metadata(10).step == 10
