"""Pure planning tests: no devices, no files (ckpt/shards/plan.py)."""

import itertools
import math
import random

import numpy as np
import pytest

from ckpt.shards import plan
from ckpt.shards.plan import Box, Shard


# ---- a device-free model of a jax mesh --------------------------------------

def mesh_index_map(shape, mesh_shape, spec, devices_per_process):
  """What ``NamedSharding(mesh, P(*spec)).devices_indices_map(shape)`` gives
  for a mesh of devices 0..N-1 in row-major order, plus each device's process
  (device // devices_per_process). Dims that do not divide are cut like jax:
  ceil-sized parts, the last one short."""
  names = list(mesh_shape)
  sizes = [mesh_shape[n] for n in names]
  spec = list(spec) + [None] * (len(shape) - len(spec))
  index_map, process_of = {}, {}
  for device, coords in enumerate(itertools.product(*map(range, sizes))):
    coord = dict(zip(names, coords))
    index = []
    for n, axes in zip(shape, spec):
      axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
      parts, part = 1, 0
      for a in axes:
        parts, part = parts * mesh_shape[a], part * mesh_shape[a] + coord[a]
      size = -(-n // parts)
      index.append(slice(min(part * size, n), min((part + 1) * size, n)))
    index_map[device] = tuple(index)
    process_of[device] = device // devices_per_process
  return index_map, process_of


def global_shards(shape, mesh_shape, spec, devices_per_process):
  index_map, process_of = mesh_index_map(shape, mesh_shape, spec,
                                         devices_per_process)
  return plan.shards_from_index_map(shape, index_map, process_of)


class Leaf:
  """One leaf of a simulated job: its global shards and a layout per process."""

  def __init__(self, shape, itemsize, shards, n, target=plan.DEFAULT_CHUNK_BYTES):
    self.shape, self.itemsize, self.shards = tuple(shape), itemsize, shards
    self.per_process = [
        plan.leaf_layout(shape, itemsize,
                         plan.placement_from_shards(shape, shards, p), target)
        for p in range(n)]
    # Every process computes the same chunk shape from its own view.
    assert len({lay.chunks for lay in self.per_process}) == 1
    self.chunks = self.per_process[0].chunks


def layout_for(shape, itemsize, mesh_shape, spec, devices_per_process,
               target=plan.DEFAULT_CHUNK_BYTES):
  n = math.prod(mesh_shape.values()) // devices_per_process
  return Leaf(shape, itemsize, global_shards(shape, mesh_shape, spec,
                                             devices_per_process), n, target)


def replicated(shape, n, itemsize=4, target=plan.DEFAULT_CHUNK_BYTES):
  """A host value every process holds whole."""
  box = Box((0,) * len(shape), tuple(shape))
  return Leaf(shape, itemsize,
              [Shard(box, tuple((p, None) for p in range(n)))], n, target)


def plan_all(leaves, n, max_item_bytes=None):
  """Every process plans its own writes; the union of them all."""
  writes = []
  for p in range(n):
    mine = plan.assign_writes([lf.per_process[p] for lf in leaves], p,
                              max_item_bytes)
    assert all(w.process == p for w in mine)
    writes.extend(mine)
  return writes


def coverage(layout, writes):
  """How many times each element of the leaf is written."""
  count = np.zeros(layout.shape, dtype=np.int32)
  for w in writes:
    count[w.box.slices()] += 1
  return count


# ---- Box --------------------------------------------------------------------

def test_box_from_index_and_geometry():
  b = Box.from_index((slice(2, 6), slice(None)), (10, 7))
  assert b == Box((2, 0), (6, 7))
  assert b.shape == (4, 7) and b.size == 28
  assert b.slices() == (slice(2, 6), slice(0, 7))
  inner = Box((3, 2), (5, 4))
  assert inner.relative_to(b) == (slice(1, 3), slice(2, 4))
  # Slices past the end are clipped to the shape, like numpy.
  assert Box.from_index((slice(8, 20),), (10,)) == Box((8,), (10,))
  assert Box.from_index((), ()).size == 1  # a scalar is one element


@pytest.mark.parametrize("start,stop", [((0,), (0, 1)), ((3,), (2,)),
                                        ((-1,), (2,))])
def test_box_rejects_invalid(start, stop):
  with pytest.raises(ValueError, match="invalid box"):
    Box(start, stop)


def test_box_rejects_strided_index():
  with pytest.raises(ValueError, match="strided"):
    Box.from_index((slice(0, 10, 2),), (10,))


def test_shard_needs_a_holder_and_picks_device_deterministically():
  with pytest.raises(ValueError, match="no holder"):
    Shard(Box((0,), (4,)), ())
  s = Shard(Box((0,), (4,)), ((1, 7), (0, 3), (1, 5)))
  assert s.processes == (0, 1)
  assert s.device_on(1) == 5
  assert s.device_on(0) == 3


# ---- chunk_shape ------------------------------------------------------------

def _divides(chunk, unit):
  return all(u % c == 0 for c, u in zip(chunk, unit))


@pytest.mark.parametrize("unit,itemsize,target", [
    ((1024, 1024), 4, 1 << 20),
    ((4096, 512, 3), 2, 1 << 20),
    ((6, 10, 14), 8, 256),
    ((360, 720), 4, 4096),
    ((2**20,), 1, 1000),
    ((48, 96, 12, 5), 4, 12345),
])
def test_chunk_shape_divides_unit_and_fits_target(unit, itemsize, target):
  chunk = plan.chunk_shape(unit, itemsize, target)
  assert len(chunk) == len(unit)
  assert all(c >= 1 for c in chunk)
  assert _divides(chunk, unit), (chunk, unit)
  nbytes = math.prod(chunk) * itemsize
  assert nbytes <= target, (chunk, nbytes, target)


def test_chunk_shape_is_near_target():
  # Powers of two: every cut halves, so the chunk lands in (target/2, target].
  for unit, itemsize, target in [((1024, 1024), 4, 1 << 20),
                                 ((8192, 256), 2, 3 << 20),
                                 ((64, 64, 64), 8, 100_000)]:
    chunk = plan.chunk_shape(unit, itemsize, target)
    nbytes = math.prod(chunk) * itemsize
    assert target / 2 < nbytes <= target, (unit, chunk, nbytes)
  # Already small enough: untouched.
  assert plan.chunk_shape((100, 30), 4, 1 << 20) == (100, 30)
  # The largest dimension is cut first, so chunks stay roughly square.
  assert plan.chunk_shape((4096, 4096), 4, 4 << 20) == (1024, 1024)


def test_chunk_shape_prime_dims():
  # A prime dimension is left whole when cutting the others is enough...
  assert plan.chunk_shape((13, 4096), 4, 64 << 10) == (13, 1024)
  # ...and is cut to 1 (the only divisor) only when it must be.
  assert plan.chunk_shape((1009, 4), 4, 1000) == (1, 4)
  assert plan.chunk_shape((1009,), 4, 100) == (1,)
  # Composite dims are cut by their smallest prime factor, staying divisors.
  chunk = plan.chunk_shape((3 * 7 * 11, 5 * 13), 8, 2000)
  assert _divides(chunk, (231, 65)) and math.prod(chunk) * 8 <= 2000


def test_chunk_shape_zero_size_dims_never_zero():
  for unit in [(0,), (0, 5), (7, 0, 3), (0, 0)]:
    chunk = plan.chunk_shape(unit, 4, 64)
    assert all(c >= 1 for c in chunk), (unit, chunk)
  # And through a whole layout of an empty array.
  lay = replicated((0, 12), 2)
  assert all(c >= 1 for c in lay.chunks)
  writes = plan_all([lay], 2)
  assert sum(w.nbytes for w in writes) == 0


def test_chunk_shape_when_target_below_one_element():
  # Cannot go below one element per dimension; it must still terminate.
  assert plan.chunk_shape((8, 8), 4, 1) == (1, 1)
  assert plan.chunk_shape((), 4, 1) == ()


def test_chunk_shape_random_units_always_divide(rng):
  for _ in range(200):
    rank = int(rng.integers(1, 5))
    unit = tuple(int(d) for d in rng.integers(1, 400, size=rank))
    itemsize = int(rng.choice([1, 2, 4, 8]))
    target = int(rng.integers(1, 1 << 22))
    chunk = plan.chunk_shape(unit, itemsize, target)
    assert _divides(chunk, unit), (unit, chunk)
    assert (math.prod(chunk) * itemsize <= target or
            all(c == 1 for c in chunk)), (unit, itemsize, target, chunk)


# ---- grid_unit and shards ---------------------------------------------------

def _shards_1d(bounds, n):
  return [Shard(Box((a,), (b,)), ((i, i),))
          for i, (a, b) in enumerate(zip(bounds, bounds[1:] + [n]))]


def test_grid_unit_even_and_uneven_shards():
  assert plan.grid_unit((12,), _shards_1d([0, 4, 8], 12)) == (4,)
  # Uneven: [0,6) [6,10): gcd(6, 6, 4) = 2.
  assert plan.grid_unit((10,), _shards_1d([0, 6], 10)) == (2,)
  # jax-style ceil cut of 10 over 4: [0,3) [3,6) [6,9) [9,10) -> 1.
  assert plan.grid_unit((10,), _shards_1d([0, 3, 6, 9], 10)) == (1,)
  # A dimension that no shard cuts keeps its full extent.
  index_map, procs = mesh_index_map((12, 5), {"x": 3}, ("x", None), 1)
  shards = plan.shards_from_index_map((12, 5), index_map, procs)
  assert plan.grid_unit((12, 5), shards) == (4, 5)


def test_uneven_shards_chunks_never_straddle():
  shape = (10, 6)
  index_map, procs = mesh_index_map(shape, {"x": 4}, ("x",), 1)
  assert index_map[3] == (slice(9, 10), slice(0, 6))  # the short last part
  shards = plan.shards_from_index_map(shape, index_map, procs)
  lay = Leaf(shape, 4, shards, 4, target=8)
  for s in shards:
    for b in plan.chunk_boxes(s.box, lay.chunks):
      assert all(s.box.start[d] <= b.start[d] and b.stop[d] <= s.box.stop[d]
                 for d in range(2))
      assert all(b.start[d] % lay.chunks[d] == 0 for d in range(2))
  writes = plan_all([lay], 4)
  assert (coverage(lay, writes) == 1).all()


def test_shards_from_index_map_groups_replicas():
  # (data=2, model=4), spec P(None, "model"): each column block is held by
  # the two devices of one model index, on different processes.
  index_map, procs = mesh_index_map((8, 16), {"data": 2, "model": 4},
                                    (None, "model"), devices_per_process=4)
  shards = plan.shards_from_index_map((8, 16), index_map, procs)
  assert [s.box for s in shards] == [Box((0, 4 * m), (8, 4 * m + 4))
                                     for m in range(4)]
  for m, s in enumerate(shards):
    assert sorted(d for _, d in s.holders) == [m, m + 4]
    assert s.processes == (0, 1)
  # Fully replicated over 8 devices: one shard, eight holders.
  index_map, procs = mesh_index_map((8, 16), {"data": 2, "model": 4}, (), 2)
  (only,) = plan.shards_from_index_map((8, 16), index_map, procs)
  assert len(only.holders) == 8 and only.processes == (0, 1, 2, 3)
  assert only.box == Box((0, 0), (8, 16))


def test_shards_from_index_map_ignores_dict_order():
  index_map, procs = mesh_index_map((8, 16), {"data": 2, "model": 4},
                                    ("data",), 2)
  items = list(index_map.items())
  random.Random(0).shuffle(items)
  a = plan.shards_from_index_map((8, 16), index_map, procs)
  b = plan.shards_from_index_map((8, 16), dict(items), procs)
  assert a == b


def test_leaf_layout_splits_replicated_shard_for_each_holder():
  # 16 MiB replicated over 4 processes: chunks of at most a quarter, so
  # every holder gets a part, even though chunk_bytes allows the whole leaf.
  shape = (4096, 1024)
  lay = replicated(shape, 4)
  assert math.prod(lay.chunks) * 4 <= (16 << 20) // 4
  writes = plan_all([lay], 4)
  assert sorted({w.process for w in writes}) == [0, 1, 2, 3]
  # ... but not below MIN_SPLIT_CHUNK_BYTES: a 1 MiB leaf stays one chunk.
  small = replicated((256, 1024), 4)
  assert small.chunks == (256, 1024)


# ---- assign_writes ----------------------------------------------------------

MESH_4x2 = {"data": 4, "model": 2}  # 8 devices


def realistic_layouts(devices_per_process, target=plan.DEFAULT_CHUNK_BYTES):
  """A small transformer-like state over (data=4, model=2): sharded params,
  optimizer moments, fully replicated norms and biases, uneven leaves."""
  leaves = []
  for name, shape, spec in [
      ("embed", (8192, 512), ("model", None)),
      ("attn_qkv", (512, 1536), (None, "model")),
      ("attn_out", (512, 512), ("model", None)),
      ("mlp_in", (512, 2048), ("data", "model")),
      ("mlp_out", (2048, 512), (("data", "model"), None)),
      ("ln_scale", (512,), ()),
      ("ln_bias", (512,), ()),
      ("head_bias", (8192,), ()),
      ("pos_embed", (1024, 512), ()),
      ("odd", (1001, 7), ("data",)),
  ]:
    for prefix in ("params", "mu", "nu"):
      leaves.append((f"{prefix}/{name}", shape, spec))
  return [layout_for(shape, 4, MESH_4x2, spec, devices_per_process, target)
          for _, shape, spec in leaves]


@pytest.mark.parametrize("devices_per_process", [1, 2, 4, 8])
@pytest.mark.parametrize("target", [plan.DEFAULT_CHUNK_BYTES, 64 << 10])
def test_assign_writes_every_element_exactly_once(devices_per_process, target):
  layouts = realistic_layouts(devices_per_process, target)
  n = 8 // devices_per_process
  writes = plan_all(layouts, n)
  for i, lay in enumerate(layouts):
    mine = [w for w in writes if w.leaf == i]
    assert (coverage(lay, mine) == 1).all(), f"leaf {i}"
    for w in mine:
      shard = next(s for s in lay.shards if s.box == w.shard)
      # The writer holds the shard, reads it from one of its own devices,
      # and the box lies inside the shard.
      assert w.process in shard.processes
      assert (w.process, w.device) in shard.holders
      assert all(a <= b and c <= d for a, b, c, d in
                 zip(shard.box.start, w.box.start, w.box.stop, shard.box.stop))
      assert w.nbytes == w.box.size * lay.itemsize
  assert all(0 <= w.process < n for w in writes)


def test_assign_writes_random_shapes_cover_exactly_once(rng):
  for trial in range(30):
    rank = int(rng.integers(1, 4))
    shape = tuple(int(d) for d in rng.integers(1, 40, size=rank))
    spec = [None] * rank
    for a in ("data", "model"):  # each mesh axis shards at most one dim
      if rng.random() < 0.6:
        d = int(rng.integers(rank))
        spec[d] = a if spec[d] is None else (spec[d], a)
    spec = tuple(spec)
    dpp = int(rng.choice([1, 2, 4]))
    target = int(rng.integers(16, 4096))
    lay = layout_for(shape, 4, MESH_4x2, spec, dpp, target)
    writes = plan_all([lay], 8 // dpp)
    assert (coverage(lay, writes) == 1).all(), (trial, shape, spec, dpp)


def test_shard_held_by_one_process_is_written_whole_by_it():
  # (data=4, model=2), P("data", "model"), one device per process: every
  # shard has exactly one holder.
  lay = layout_for((64, 32), 4, MESH_4x2, ("data", "model"), 1, target=64)
  writes = plan_all([lay], 8)
  assert len(writes) == 8
  for w in writes:
    (holder,) = [s for s in lay.shards if s.box == w.box]
    assert holder.processes == (w.process,)
  # Two devices of one process hold the same block (model axis inside the
  # process): still one write, by that process.
  lay = layout_for((64, 32), 4, MESH_4x2, ("data",), 2, target=64)
  writes = plan_all([lay], 4)
  assert sorted((w.box.start, w.process) for w in writes) == [
      ((16 * p, 0), p) for p in range(4)]


def test_fully_replicated_leaf_is_spread_over_processes():
  shape = (2048, 1024)  # 8 MiB f32, replicated on 4 processes
  index_map, procs = mesh_index_map(shape, MESH_4x2, (), 2)
  shards = plan.shards_from_index_map(shape, index_map, procs)
  lay = Leaf(shape, 4, shards, 4)
  writes = plan_all([lay], 4)
  per_process = np.zeros(4)
  for w in writes:
    per_process[w.process] += w.nbytes
  assert per_process.sum() == 8 << 20
  assert per_process[0] < per_process.sum()  # not all on process 0
  assert (per_process > 0).all()
  assert per_process.max() <= 1.5 * per_process.sum() / 4


def test_many_small_replicated_leaves_are_spread():
  # Each leaf is one chunk (below the split minimum); whole leaves spread.
  layouts = [replicated((64, 64), 4) for _ in range(40)]
  writes = plan_all(layouts, 4)
  counts = np.bincount([w.process for w in writes], minlength=4)
  assert counts.tolist() == [10, 10, 10, 10]


@pytest.mark.parametrize("devices_per_process", [1, 2, 4])
def test_per_process_bytes_within_1_5x_of_equal_share(devices_per_process):
  n = 8 // devices_per_process
  layouts = realistic_layouts(devices_per_process)
  writes = plan_all(layouts, n)
  per_process = np.zeros(n)
  for w in writes:
    per_process[w.process] += w.nbytes
  total = sum(math.prod(l.shape) * l.itemsize for l in layouts)
  assert per_process.sum() == total
  share = total / n
  assert per_process.max() <= 1.5 * share, per_process / share
  assert per_process.min() >= share / 1.5, per_process / share


def test_assign_writes_is_deterministic():
  a = plan_all(realistic_layouts(2, 64 << 10), 4)
  # Recompute from scratch (fresh shards; the chunk cache cleared).
  plan.chunk_shape.cache_clear()
  b = plan_all(realistic_layouts(2, 64 << 10), 4)
  assert a == b
  for p in range(4):
    mine = [w for w in a if w.process == p]
    assert mine == sorted(mine, key=lambda w: (w.leaf, w.box.start))


def test_assign_writes_no_leaves():
  assert plan.assign_writes([], 3) == []


def test_shards_over_max_item_bytes_are_written_chunk_by_chunk():
  # One process holds each 1 MiB shard; a 256 KiB item limit cuts each into
  # chunk-sized writes, all by that process, still covering every element once.
  limit = 256 << 10
  lay = layout_for((1024, 1024), 4, MESH_4x2, ("data",), 2, target=limit)
  writes = plan_all([lay], 4, max_item_bytes=limit)
  assert (coverage(lay, writes) == 1).all()
  assert max(w.nbytes for w in writes) <= limit
  assert len(writes) == 4 * 4
  for w in writes:
    (shard,) = [s for s in lay.shards if s.box == w.shard]
    assert shard.processes == (w.process,)
  # Without the limit, one write per shard.
  assert len(plan_all([lay], 4)) == 4
