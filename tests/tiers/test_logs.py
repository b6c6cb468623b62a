"""Issue 45 item 7: what a multi-tier job logs. One INFO line per save and
per restore of each tier (the local tier's saves logged nothing), rates of
small amounts in MB/s (they read "0.00 GB/s"), and no per-step INFO lines
of the local tier's reasons (a WARNING says once what a resume passed over:
tests/tiers/test_restart_drift.py)."""

from __future__ import annotations

import logging
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt


def _lines(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records
          if r.getMessage().startswith("ckpt:")]


def test_one_line_per_save_and_restore_of_each_tier(tmp_path, caplog):
  sharding = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4),
                                ("a", "b")), P("a", "b"))
  value = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
  target = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype,
                                      sharding=sharding)}
  with ckpt.MultiTierCheckpointer(tmp_path / "p", local=tmp_path / "l",
                                  persistent_interval=2) as mt:
    with caplog.at_level(logging.INFO):
      mt.save(1, {"w": jax.device_put(value, sharding)})   # local only
      mt.save(2, {"w": jax.device_put(value, sharding)})   # both
      mt.wait_until_finished()
    saves = [m for m in _lines(caplog) if m.startswith("ckpt: saved step")]
    assert [int(re.match(r"ckpt: saved step (\d+) to the local tier ",
                         m).group(1)) for m in saves if "local tier" in m
            ] == [1, 2], saves
    assert len([m for m in saves if "local tier" not in m]) == 1, saves
    caplog.clear()
    with caplog.at_level(logging.INFO):
      got = mt.restore(target=target)
      assert mt.last_restore_tier == "local"
      mt.restore(2, target=target, lazy=True)  # the persistent tier's
    assert np.array_equal(np.asarray(got["w"]), value)
    restores = [m for m in _lines(caplog) if m.startswith("ckpt: restored")]
    assert len(restores) == 2, restores
    assert restores[0].startswith(
        "ckpt: restored step 2 from the local tier "), restores
    assert "this process read 16.00 KiB in " in restores[0], restores
  for m in saves + restores:  # 16 KiB: never "0.00 GB/s"
    assert re.search(r"\(\d+(\.\d+)? MB/s", m), m
  assert not [m for m in _lines(caplog) if "local tier on process" in m]
