"""Packed leaves restored onto CPU devices are placed together
(ckpt/restore/placed.py ``Batch``): each leaf read whole, the restore's
leaves put on their shardings by one ``jax.device_put`` of the list (or a
few), not one ``make_array_from_callback`` each; a failure of that call
fails the restore, and no leaf waits for it forever."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ckpt.restore import placed
from tests.conftest import mesh


def _state(n=60):
  m = mesh()
  rng = np.random.default_rng(3)
  out = {}
  for i in range(n):  # replicated, sharded on rows, on columns, int32
    spec = [P(), P("model", None), P(None, "model"), P("data")][i % 4]
    dtype = np.int32 if i % 4 == 3 else np.float32
    x = (rng.standard_normal((16, 8)) * 50).astype(dtype)
    out[f"l{i:03d}"] = jax.device_put(x, NamedSharding(m, spec))
  return out


def _counting(monkeypatch, module, name):
  calls = []
  real = getattr(module, name)

  def counted(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)
  monkeypatch.setattr(module, name, counted)
  return calls


def test_packed_leaves_placed_in_one_batch(make_ckptr, monkeypatch):
  state = _state()
  c = make_ckptr(async_save=False)
  c.save(1, state)
  callbacks = _counting(monkeypatch, jax, "make_array_from_callback")
  batches = _counting(monkeypatch, placed.Batch, "_place")
  got = c.restore(1, target=state)
  assert not callbacks  # none placed alone
  assert 1 <= len(batches) <= 3, len(batches)
  for name, want in state.items():
    have = got[name]
    assert have.sharding == want.sharding, name
    assert have.dtype == want.dtype, name
    np.testing.assert_array_equal(np.asarray(have), np.asarray(want),
                                  err_msg=name)
  # A cast on the way, onto another sharding: each leaf still as it was.
  m = mesh()
  floats = {k: v for k, v in state.items() if v.dtype == np.float32}
  target = {k: jax.ShapeDtypeStruct(v.shape, jnp.bfloat16, sharding=
                                    NamedSharding(m, P(None, "data")))
            for k, v in floats.items()}
  got = c.restore(1, target=target)
  for name, want in floats.items():
    assert got[name].dtype == jnp.bfloat16
    assert got[name].sharding == target[name].sharding
    np.testing.assert_array_equal(
        np.asarray(got[name]), np.asarray(want).astype(jnp.bfloat16))


def test_a_failed_batch_fails_the_restore(make_ckptr, monkeypatch):
  state = _state(12)
  c = make_ckptr(async_save=False)
  c.save(1, state)
  real = jax.device_put

  def broken(x, *args, **kwargs):
    if isinstance(x, list):  # the batch's call
      raise RuntimeError("device_put refused the batch")
    return real(x, *args, **kwargs)
  monkeypatch.setattr(placed.jax, "device_put", broken)
  with pytest.raises(Exception, match="device_put refused the batch"):
    c.restore(1, target=state)
  monkeypatch.setattr(placed.jax, "device_put", real)
  got = c.restore(1, target=state)  # the Checkpointer still restores
  np.testing.assert_array_equal(np.asarray(got["l000"]),
                                np.asarray(state["l000"]))
