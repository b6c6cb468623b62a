"""Issue 45 item 3: a local step saved on other shardings than the
target's is restored from the local tier when each process holds every
byte it needs (here one process of 8 devices holds them all): its own
shards, reassembled into the target's boxes. Before, the restore went to
the persistent tier ("sharded differently from the save"), which held
nothing here. Across processes: tests/tiers/test_restart_drift.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt


@pytest.mark.parametrize("spec", [P("b", "a"), P(), P(None, "b"), P("a")])
def test_a_local_step_restores_onto_other_shardings(tmp_path, spec):
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  saved = NamedSharding(mesh, P("a", "b"))
  want = NamedSharding(mesh, spec)
  key = jax.random.key(3)
  with ckpt.MultiTierCheckpointer(tmp_path / "p", local=tmp_path / "l") as mt:
    mt.save(1, {"w": jax.device_put(value, saved),
                "k": jax.device_put(key, saved.update(spec=P()))})
    mt.wait_until_finished()
    got = mt.restore(target={
        "w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=want),
        "k": jax.ShapeDtypeStruct((), key.dtype, sharding=want.update(
            spec=P()))})
    assert (mt.last_restore_tier, mt.last_restore_step) == ("local", 1)
  assert got["w"].sharding == want
  for s in got["w"].addressable_shards:
    assert np.array_equal(np.asarray(s.data), value[s.index])
  assert np.array_equal(jax.random.key_data(got["k"]),
                        jax.random.key_data(key))
