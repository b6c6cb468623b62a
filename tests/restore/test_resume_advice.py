"""Issue 45 item 4: the Orbax resume idiom, ``restore(latest_step(), ...)``,
names a step, so a damaged newest step raises instead of falling back;
the error says how to resume from the newest step that verifies, and that
form (docs/migrating.md: ``restore(target=...)``) does."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

import ckpt

SHAPE = (256, 512)  # float32, 512 KiB: stored, not packed


def test_an_explicit_damaged_step_says_how_to_resume(tmp_path):
  value = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(1, {"w": value})
    c.save(2, {"w": value + 1})
  chunks = [p for p in pathlib.Path(tmp_path, "checkpoint_2").rglob("*")
            if p.is_file() and p.stat().st_size >= 16 << 10]
  data = bytearray(chunks[0].read_bytes())
  data[len(data) // 2] ^= 0x10
  chunks[0].write_bytes(bytes(data))
  target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32)}
  with ckpt.Checkpointer(tmp_path) as c:
    with pytest.raises(ckpt.CorruptCheckpointError,
                       match=r"To resume from the newest step that verifies, "
                       r"restore without a step \(restore\(target=\.\.\.\)\)"):
      c.restore(c.latest_step(), target=target)
    got = c.restore(target=target)
    assert c.last_restore_step == 1
    assert np.array_equal(np.asarray(got["w"]), value)
