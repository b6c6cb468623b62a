"""A stacked leaf (ckpt/restore/lazy_derived.py LazyStack, made by transforms.stack_layers)
restores within ``concurrent_bytes``: its members are read straight into
the output box (or one at a time, counted in the budget), never all held
next to a stacked copy.

Eight 1 MiB layers are stacked into one 8 MiB leaf and restored with a
2 MiB budget, whole on one device (one box larger than the budget), split
over 8 devices (boxes of 1 MiB), cast to bfloat16 (members cast one at a
time) and lazily. The peak of Python-tracked host memory (tracemalloc:
numpy's buffers) during the restore, above what was allocated before it,
must stay within the result's bytes + the budget + one layer (MARGIN).
Before, a box of the stack held every member's box plus an np.stack copy
of them besides the output: 8 MiB over the result for the whole leaf.
"""

from __future__ import annotations

import gc
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import ckpt
from ckpt.restore import transforms as T

LAYERS = 8
LAYER = (256, 1024)  # float32: 1 MiB
BUDGET = 2 << 20
MARGIN = 1 << 20


def layer(i: int) -> np.ndarray:
  return (np.arange(LAYER[0] * LAYER[1], dtype=np.float32).reshape(LAYER)
          + i * 1000.5)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("stack") / "ck")
  with ckpt.Checkpointer(root, async_save=False) as ck:
    ck.save(1, {f"layers_{i}": {"w": layer(i)} for i in range(LAYERS)})
  return root


def shardings():
  devs = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devs), ("x",))
  return {"one_device": SingleDeviceSharding(devs[0]),
          "split_8": NamedSharding(mesh, P(None, "x"))}


@pytest.mark.parametrize("how", ["one_device", "split_8", "bfloat16", "lazy"])
def test_stacked_leaf_restores_within_the_budget(saved, how):
  sharding = shardings()["split_8" if how == "split_8" else "one_device"]
  dtype = ml_dtypes.bfloat16 if how == "bfloat16" else np.float32
  shape = (LAYERS,) + LAYER
  target = {"layers": {"w": jax.ShapeDtypeStruct(shape, dtype,
                                                 sharding=sharding)}}
  want = np.stack([layer(i) for i in range(LAYERS)]).astype(dtype)
  with ckpt.Checkpointer(saved, concurrent_bytes=BUDGET) as ck:
    gc.collect()
    tracemalloc.start()
    try:
      base = tracemalloc.get_traced_memory()[0]
      got = ck.restore(1, target=target, lazy=how == "lazy",
                       transforms=(T.stack_layers(r"layers_(\d+)", "layers"),))
      w = got["layers"]["w"]
      if how == "lazy":
        w = w.read()
      peak = tracemalloc.get_traced_memory()[1] - base
    finally:
      tracemalloc.stop()
  result = int(np.prod(shape)) * np.dtype(dtype).itemsize
  print(f"{how}: peak {peak / 2**20:.2f} MiB, result {result / 2**20:.2f} MiB")
  assert w.sharding == sharding and w.dtype == dtype
  assert np.array_equal(np.asarray(w), want)
  assert peak <= result + BUDGET + MARGIN, (
      f"peak {peak / 2**20:.2f} MiB over a result of {result / 2**20:.2f} "
      f"MiB with a {BUDGET / 2**20:.0f} MiB budget")
