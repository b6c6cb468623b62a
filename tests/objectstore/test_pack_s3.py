"""Packed small leaves on buckets (moto S3 and the GCS emulator): each pack
is one object written through the step's kvstore, read back whole or by
byte range (a partial restore), and a flipped byte in it is caught."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli import integrity
from ckpt.restore import pack_read
from tests.objectstore import storeutil


def _state():
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(3)
  return {"w": jax.device_put(rng.standard_normal((64, 16), dtype=np.float32),
                              NamedSharding(mesh, P("model"))),
          "b": rng.standard_normal((300,)).astype(np.float32),
          "big": rng.standard_normal((20000,), dtype=np.float32)}


@pytest.mark.parametrize("store", ["s3", "gs"])
def test_packed_leaves_on_a_bucket(store, s3_bucket, gs_bucket, monkeypatch):
  url = f"{s3_bucket if store == 's3' else gs_bucket}/run"
  state = _state()
  with ckpt.Checkpointer(url, async_save=False) as c:
    c.save(1, state)
  keys = storeutil.keys(url)
  packs = [k for k in keys if "/.packs/" in k]
  assert sorted(k.rsplit("/", 1)[1] for k in packs) == ["0.0.bin", "0.msgpack"]
  assert not any("/w/" in k or "/b/" in k for k in keys), keys
  assert any("/big/" in k for k in keys)
  got = ckpt.load(url)
  for k, v in state.items():
    assert np.array_equal(np.asarray(got[k]), np.asarray(v)), k
  # A partial restore reads the byte range of its leaf only.
  ranges = []
  real = pack_read.PackSet._range

  def spy(self, kv, p, k, a, b):
    ranges.append(b - a)
    return real(self, kv, p, k, a, b)

  monkeypatch.setattr(pack_read, "_MERGE_GAP", 0)
  monkeypatch.setattr(pack_read.PackSet, "_range", spy)
  with ckpt.Checkpointer(url) as c:
    got = c.restore(1, target={"b": jax.ShapeDtypeStruct((300,), jnp.float32)})
  assert np.array_equal(got["b"], state["b"]) and ranges == [1200]
  # A flipped byte in the pack object: verify names the leaf.
  key = next(k for k in packs if k.endswith(".bin"))
  data = bytearray(storeutil.read_key(url, key))
  data[3] ^= 1  # inside b, the first box (leaves in order: b, big, w)
  storeutil.write_key(url, key, bytes(data))
  problems = integrity.verify(url)
  assert [p.path for p in problems] == ["b"], problems
