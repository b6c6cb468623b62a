"""Issue 44 item 7 (one of its smaller items): a resume's fall back
considers every tier's steps, newest first. With local step 4 and
persistent step 4 damaged, a ``MultiTierCheckpointer`` resumed persistent
step 2 and passed over local step 3, which verifies; it resumes local
step 3 now, and the next save proceeds."""

from __future__ import annotations

import logging
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt

SHAPE = (256, 512)  # float32, 512 KiB: stored, not packed


def _flip(path: pathlib.Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10
  path.write_bytes(bytes(data))


@pytest.mark.parametrize("call", ["restore", "restore_async"])
def test_a_damaged_newest_step_in_both_tiers_resumes_the_local_step_below(
    tmp_path, caplog, call):
  sharding = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4),
                                ("a", "b")), P("a", "b"))
  base = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)

  def state(step):
    return {"w": jax.device_put(base + step, sharding), "step": step}

  target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding),
            "step": 0}

  def tiers():
    return ckpt.MultiTierCheckpointer(
        tmp_path / "persistent", local=tmp_path / "local", local_interval=1,
        local_keep=2, persistent_interval=2, persistent_keep=3)

  with tiers() as mt:
    for step in range(1, 5):
      mt.save(step, state(step))
  assert sorted(p.name for p in (tmp_path / "local" / "process_0").iterdir()
                ) == ["step_3", "step_4"]
  _flip(tmp_path / "local" / "process_0" / "step_4" / "own.bin")
  chunks = [p for p in (tmp_path / "persistent" / "checkpoint_4").rglob("*")
            if p.is_file() and p.stat().st_size >= 16 << 10]
  assert chunks
  for p in chunks:
    _flip(p)
  with tiers() as mt:
    with caplog.at_level(logging.WARNING):
      if call == "restore":
        got = mt.restore(target=target)
      else:
        got = mt.restore_async(target=target).result()
    assert (mt.last_restore_step, mt.last_restore_tier) == (3, "local")
    assert got["step"] == 3 and np.array_equal(np.asarray(got["w"]),
                                                base + 3)
    assert any("local tier's step 3 is newer: resuming it instead" in
               r.getMessage() for r in caplog.records), caplog.text
    assert mt.latest_step() == 3
    assert mt.save(4, state(4))  # the damaged steps do not block it
    mt.wait_until_finished()
    assert mt.latest_step() == 4
  with tiers() as mt:
    got = mt.restore(target=target)
    assert (mt.last_restore_step, got["step"]) == (4, 4)
    assert np.array_equal(np.asarray(got["w"]), base + 4)
