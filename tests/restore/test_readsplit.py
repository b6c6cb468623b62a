"""The pure parts of ckpt/restore/readsplit.py: how chunks are dealt to readers,
and the exchange's sum of integers (bit-exact for every dtype it takes).

The splits themselves run across real processes in
tests/multiprocess/test_readonce_fetch.py and
tests/objectstore/test_readonce_fetch.py."""

from __future__ import annotations

import itertools
import math
import random
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ckpt.restore import readsplit


def chunk_split(shape, chunks, ways, r, rotation=0):
  """A ChunkSplit over a described mesh: dimension d of the target is cut
  ways[d] times (mesh axis "m<d>"), R readers on axis "data"."""
  sizes = {f"m{d}": w for d, w in enumerate(ways)}
  spec = tuple(f"m{d}" if w > 1 else None for d, w in enumerate(ways))
  sharding = types.SimpleNamespace(
      mesh=types.SimpleNamespace(shape={**sizes, "data": r}), spec=spec)
  return readsplit.ChunkSplit(sharding, r, ("data",), spec, tuple(shape),
                              tuple(chunks), rotation)


def tiles(shape, ways):
  per = [n // w for n, w in zip(shape, ways)]
  for pos in itertools.product(*(range(w) for w in ways)):
    yield ([p * t for p, t in zip(pos, per)],
           [(p + 1) * t for p, t in zip(pos, per)])


def owners_of_tile(split, start, stop):
  lo = [a // c for a, c in zip(start, split.chunks)]
  hi = [(b - 1) // c + 1 for b, c in zip(stop, split.chunks)]
  return lo, hi, split.owners(lo, hi)


@pytest.mark.parametrize("seed", range(30))
def test_every_target_box_deals_its_chunks_round_robin(seed):
  rng = random.Random(seed)
  rank = rng.randint(1, 3)
  r = rng.choice([2, 3, 4, 8])
  ways = [rng.choice([1, 1, 2, 4]) for _ in range(rank)]
  tile = [rng.randint(1, 40) for _ in range(rank)]
  shape = [t * w for t, w in zip(tile, ways)]
  aligned = rng.random() < 0.5
  chunks = [rng.choice([c for c in range(1, t + 1) if t % c == 0])
            if aligned else rng.randint(1, n)
            for t, n in zip(tile, shape)]
  split = chunk_split(shape, chunks, ways, r, rotation=rng.randrange(r))
  # One reader per chunk, the same seen from every box it meets.
  grid = [-(-n // c) for n, c in zip(shape, chunks)]
  whole = split.owners([0] * rank, grid)
  for start, stop in tiles(shape, ways):
    lo, hi, got = owners_of_tile(split, start, stop)
    sl = tuple(slice(a, b) for a, b in zip(lo, hi))
    assert (got == whole[sl]).all()
    counts = np.bincount(got.ravel(), minlength=r)
    if aligned:  # each reader within one chunk of an equal share
      assert counts.max() - counts.min() <= 1, (counts, shape, chunks, ways)


def test_fewer_chunks_than_readers_rotate_over_leaves():
  # One chunk per leaf, 4 readers: leaf i (rotation i) goes to reader i % 4.
  got = [int(chunk_split((3000,), (3000,), (1,), 4, rotation=i).owners(
      [0], [1])[0]) for i in range(8)]
  assert got == [0, 1, 2, 3, 0, 1, 2, 3]


def _parts(data: np.ndarray, r: int, rng) -> np.ndarray:
  """R buffers of data's unsigned bits, each element kept in one of them
  (zeros elsewhere), as the readers of a ChunkSplit fill them."""
  ints = data.view(readsplit.sum_dtype(data.dtype))
  owner = rng.integers(0, r, data.shape)
  return np.stack([np.where(owner == j, ints, 0).astype(ints.dtype)
                   for j in range(r)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8",
                                   "uint16", "int32", "bool"])
def test_the_sum_over_readers_is_bit_exact(dtype):
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(dtype)
  data = rng.standard_normal((64, 33)).astype(np.float32)
  if dtype == np.bool_:
    data = data > 0
  elif np.dtype(dtype).kind in "iu":
    data = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max,
                        (64, 33)).astype(dtype)
  else:
    data = data.astype(dtype)
    # Signed zeros, infinities, NaN payloads: bits, not values.
    flat = data.reshape(-1)
    flat[:4] = np.array([-0.0, np.inf, -np.inf, np.nan]).astype(dtype)
    if dtype == np.float32:
      flat[4] = np.array([0x7FC00123], np.uint32).view(np.float32)[0]
  (out,) = readsplit._exchange((("sum", np.dtype(dtype).name),),  # pylint: disable=protected-access
                               jnp.asarray(_parts(data, 4, rng)))
  assert out.dtype == dtype
  assert np.asarray(out).tobytes() == data.tobytes()


def test_sum_dtype():
  assert readsplit.sum_dtype(np.bool_) == np.uint8
  assert readsplit.sum_dtype(jnp.bfloat16) == np.uint16
  assert readsplit.sum_dtype(np.float32) == np.uint32
  assert readsplit.sum_dtype(np.complex64) is None
  # 64-bit integers do not exist in jax without x64: not summed then.
  want = np.uint64 if jax.config.jax_enable_x64 else None
  assert readsplit.sum_dtype(np.float64) == want


def test_nothing_is_split_in_one_process():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1),
                           ("data", "model"))
  s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  assert readsplit.plan(s, (100,), (10,), np.float32, 2) is None


def test_a_save_cuts_a_box_few_processes_hold_for_common_replica_counts():
  # 16 MiB held by 2 processes: before, 2 chunks of 8 MiB (one per holder),
  # so a read once over 4 or 8 replicas cut through them; now 8 chunks, and
  # an even split over 2, 4 or 8 readers falls on chunk boundaries.
  from ckpt.shards import placement  # pylint: disable=g-import-not-at-top
  from ckpt.shards import plan  # pylint: disable=g-import-not-at-top
  shape = (4096, 1024)
  lay = plan.leaf_layout(shape, 4, placement.host_replicated(shape, 0, 2))
  counts = [n // c for n, c in zip(shape, lay.chunks)]
  assert math.prod(counts) == plan.READ_SPLIT == 8
  for r in (2, 4, 8):
    assert any(k % r == 0 for k in counts), (r, lay.chunks)
  # Never below MIN_SPLIT_CHUNK_BYTES: a 4 MiB box makes 4 chunks.
  small = plan.leaf_layout((1024, 1024), 4,
                           placement.host_replicated((1024, 1024), 0, 2))
  assert math.prod(small.chunks) * 4 == plan.MIN_SPLIT_CHUNK_BYTES
