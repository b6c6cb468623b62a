"""Read once: how a leaf's read is split over its replica readers.

R readers (the devices along the replica axes: mesh axes the target spec
does not use, along which the process changes) hold the same box of a
leaf; each reads a distinct part, and the parts are exchanged
(ckpt/restore/readonce.py). A store serves whole chunks (an object per chunk, a
chunk decoded whole), so a part that cuts through a chunk costs a whole
fetch of it, and two devices of one process reading two parts of one chunk
fetch it twice. Two splits, planned from global information only (the same
on every process):

- ``EvenSplit``: the target spec with one dimension further split over the
  replica axes (the "read sharding", a NamedSharding); the exchange is an
  all-gather (a jit identity into the target sharding). Used where every
  box of the read sharding is a union of whole stored chunks, so that no
  chunk is fetched twice; and for leaves derived by a transform (their
  chunk grid is not a stored one), as before.
- ``ChunkSplit``: whole chunks dealt to the readers. Chunk ``g`` (its index
  in the stored chunk grid) goes to reader ``(lin(g) + rotation) mod R``,
  ``lin(g)`` its linear index in a grid whose radices are the chunk counts
  of one target box: the chunks of every box are dealt round robin (each
  reader within one chunk of an equal share), a chunk shared by two boxes
  has one reader, and leaves with fewer chunks than readers go to
  different readers (``rotation``: the leaf's place in the target). Each
  reader fills, per box its devices hold, a buffer of the box's shape with
  its chunks, zeros elsewhere, reading each chunk once (one that straddles
  two of its devices' boxes into a temporary buffer, then copied into
  both); one program then sums the R buffers as unsigned integers of the
  dtype's width (each element is non-zero in at most one of them, and
  ``x + 0 = x`` bit for bit) into the target sharding: an all-reduce.
  Against an EvenSplit it holds a whole box per device instead of 1/R (so
  twice the box with the result, in the batch's budget), and an all-reduce
  moves about twice an all-gather's bytes (measured here, 4 processes:
  0.40 s against 0.25 s for 64 MiB per device). A chunk is fetched once by
  one process, whatever the shapes, chunks and replica count, except a
  chunk that straddles target boxes held by different processes along
  axes the target spec uses (a stored grid unlike the target's): each of
  those processes fetches it, with read once or without.

Not split (read as usual, by every replica): a target whose mesh does not
span every process, no replica axis, fewer than ``min_r`` replicas; and a
derived leaf with no dimension divisible by its ways times R.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ckpt.restore.assemble import aligned_zeros, materialize, put_on_devices
from ckpt.restore.hostmem import check_fits
from ckpt.restore.tasks import gather_or_cancel
from ckpt.store.limiter import ByteLimiter
from ckpt.shards.plan import Box


@dataclasses.dataclass
class Part:
  """What one process read of a leaf, before the exchange: ``array`` (a
  global jax.Array), ``mine`` (bytes its devices hold that it read itself)
  and ``kind`` (how the exchange program turns it into the target)."""
  array: jax.Array
  mine: int
  kind: tuple


def _entry_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, (tuple, list)):
    return tuple(entry)
  return (entry,)


def _spanning_axes(mesh) -> tuple[str, ...]:
  """Mesh axes along which the process index changes."""
  procs = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
  out = []
  for i, name in enumerate(mesh.axis_names):
    if mesh.devices.shape[i] > 1 and (
        procs != np.take(procs, [0], axis=i)).any():
      out.append(name)
  return tuple(out)


_SPAN_CACHE: dict[Any, tuple] = {}


def replica_axes(sharding, ndim: int, min_r: int | None
                 ) -> tuple[tuple, tuple[str, ...], int] | None:
  """(the target spec padded to ``ndim``, the replica axes, R), or None:
  no read once for this sharding."""
  if min_r is None or not isinstance(sharding, NamedSharding):
    return None
  mesh = sharding.mesh
  if not hasattr(mesh, "devices") or jax.process_count() == 1:
    return None
  key = id(mesh), mesh
  if key not in _SPAN_CACHE:
    procs = {d.process_index for d in mesh.devices.flat}
    _SPAN_CACHE[key] = (_spanning_axes(mesh), len(procs) == jax.process_count())
  spanning, all_procs = _SPAN_CACHE[key]
  if not all_procs:  # a collective on a mesh of some processes: not here
    return None
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  used = {a for e in spec for a in _entry_axes(e)}
  axes = tuple(a for a in spanning if a not in used)
  r = math.prod(mesh.shape[a] for a in axes) if axes else 1
  if r < max(2, min_r):
    return None
  return spec, axes, r


def _ways(sharding, spec) -> list[int]:
  return [math.prod(sharding.mesh.shape[a] for a in _entry_axes(e))
          for e in spec]


def sum_dtype(dtype) -> np.dtype | None:
  """The unsigned integer a ChunkSplit sums ``dtype``'s bits as (None:
  not summable here: complex, or 64 bits without jax_enable_x64)."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return np.dtype(np.uint8)
  if dtype.kind == "c" or dtype.itemsize not in (1, 2, 4, 8):
    return None
  if dtype.kind not in "iuf" and not jax.numpy.issubdtype(
      dtype, jax.numpy.floating):
    return None
  if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
    return None
  return np.dtype(f"uint{8 * dtype.itemsize}")


def plan(sharding, shape: Sequence[int], chunks: Sequence[int] | None,
         dtype, min_r: int | None, rotation: int = 0):
  """The split of one leaf read once (an EvenSplit or a ChunkSplit), or
  None: read as usual. ``chunks``: the stored chunk grid (None: a derived
  leaf); ``dtype``: what it is read as."""
  shape = tuple(int(n) for n in shape)
  got = replica_axes(sharding, len(shape), min_r)
  if got is None or not math.prod(shape):
    return None
  spec, axes, r = got
  ways = _ways(sharding, spec)
  if any(n % w for n, w in zip(shape, ways)):
    return None  # jax shards evenly; never here
  # Even splits: (whole chunks only, part, -dimension) for each dimension
  # that divides by its ways times R; the best first.
  even = []
  for d, n in enumerate(shape):
    if n % (ways[d] * r):
      continue
    cuts = [w * (r if e == d else 1) for e, w in enumerate(ways)]
    whole = chunks is not None and all(
        k == 1 or (m // k) % c == 0 for m, k, c in zip(shape, cuts, chunks))
    even.append((whole, n // (ways[d] * r), -d))
  even.sort(reverse=True)
  if even and (chunks is None or even[0][0]):
    return _even_split(sharding, spec, axes, r, -even[0][2])
  if chunks is not None and sum_dtype(dtype) is not None:
    return ChunkSplit(sharding, r, axes, spec, shape, tuple(chunks),
                      rotation % r)
  if even:  # a dtype it cannot sum: inside chunks, as before
    return _even_split(sharding, spec, axes, r, -even[0][2])
  return None


def _even_split(sharding, spec, axes, r, d) -> "EvenSplit":
  new = list(spec)
  new[d] = _entry_axes(spec[d]) + axes
  return EvenSplit(sharding, r, NamedSharding(
      sharding.mesh, PartitionSpec(*new), memory_kind=sharding.memory_kind))


def per_process_bytes(split, shape, itemsize: int) -> int:
  """An upper bound on the host bytes one process holds for one leaf while
  it is exchanged (what it read + the gathered boxes), from global
  information only (the same number on every process)."""
  sharding = split.sharding
  mesh = sharding.mesh
  shards = math.prod(_ways(sharding, tuple(sharding.spec)))
  per_device = math.prod(shape) * itemsize // max(1, shards)
  devices = max(1, mesh.devices.size // jax.process_count())
  read = (per_device * devices if isinstance(split, ChunkSplit) else
          (per_device * devices) // split.r)
  return per_device * devices + read


# ---- the even split -----------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class EvenSplit:
  sharding: Any        # the target
  r: int
  read_sharding: Any   # the target spec, one dimension split over R more

  async def read(self, leaf, dtype, limiter: ByteLimiter) -> Part:
    arr = await materialize(leaf, dtype, self.read_sharding, limiter)
    return Part(arr, sum(s.data.nbytes for s in arr.addressable_shards),
                ("even",))

  def boxes(self, shape) -> list[Box]:
    shape = tuple(shape)
    return list({Box.from_index(i, shape) for i in
                 self.read_sharding.addressable_devices_indices_map(
                     shape).values()})


# ---- whole chunks per reader ---------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class ChunkSplit:
  sharding: Any                  # the target
  r: int
  axes: tuple[str, ...]          # the replica axes
  spec: tuple                    # the target spec, padded to the rank
  shape: tuple[int, ...]
  chunks: tuple[int, ...]        # the stored chunk grid
  rotation: int
  _local: dict = dataclasses.field(default_factory=dict, repr=False)

  @property
  def part_sharding(self) -> NamedSharding:
    """Of the parts: a leading dimension of R over the replica axes."""
    return NamedSharding(self.sharding.mesh,
                         PartitionSpec(self.axes, *self.spec),
                         memory_kind=self.sharding.memory_kind)

  def owners(self, lo: Sequence[int], hi: Sequence[int]) -> np.ndarray:
    """The reader of every chunk with grid index in [lo, hi)."""
    tile = [n // w for n, w in zip(self.shape, _ways(self.sharding,
                                                     self.spec))]
    radix = [max(1, -(-t // c)) for t, c in zip(tile, self.chunks)]
    lin = np.zeros([b - a for a, b in zip(lo, hi)], dtype=np.int64)
    for d, (a, b) in enumerate(zip(lo, hi)):
      stride = math.prod(radix[d + 1:])
      shape = [1] * len(lo)
      shape[d] = b - a
      lin = lin + (np.arange(a, b, dtype=np.int64) * stride).reshape(shape)
    return (lin + self.rotation) % self.r

  def local(self) -> tuple[dict, dict]:
    """This process's reads, once: ({(reader, box): devices holding it},
    {chunk index: [((reader, box), the part of the chunk in box)]})."""
    if self._local:
      return self._local["buffers"], self._local["pieces"]
    gshape = (self.r,) + self.shape
    index = self.part_sharding.addressable_devices_indices_map(gshape)
    buffers: dict[tuple[int, Box], list] = {}
    for device, idx in index.items():
      j = idx[0].indices(self.r)[0]
      buffers.setdefault((j, Box.from_index(idx[1:], self.shape)),
                         []).append(device)
    pieces: dict[tuple[int, ...], list] = {}
    for (j, box) in buffers:
      lo = [a // c for a, c in zip(box.start, self.chunks)]
      hi = [(b - 1) // c + 1 for b, c in zip(box.stop, self.chunks)]
      mine = np.argwhere(self.owners(lo, hi) == j) + np.array(lo)
      for g in map(tuple, mine.tolist()):
        start = tuple(max(a, i * c) for a, i, c in
                      zip(box.start, g, self.chunks))
        stop = tuple(min(b, (i + 1) * c) for b, i, c in
                     zip(box.stop, g, self.chunks))
        pieces.setdefault(g, []).append(((j, box), Box(start, stop)))
    self._local.update(buffers=buffers, pieces=pieces, index=index)
    return buffers, pieces

  def boxes(self, shape=None) -> list[Box]:
    """The boxes this process reads (one per chunk it fetches)."""
    del shape
    _, pieces = self.local()
    return [_hull([b for _, b in got]) for got in pieces.values()]

  async def read(self, leaf, dtype, limiter: ByteLimiter) -> Part:
    dtype = np.dtype(dtype)
    as_int = sum_dtype(dtype)
    if as_int is None:  # asked for a dtype it cannot sum: read everything
      arr = await materialize(leaf, dtype, self.sharding, limiter)
      return Part(arr, sum(s.data.nbytes for s in arr.addressable_shards),
                  ("even",))
    buffers, pieces = self.local()
    data = {}
    for key, devices in buffers.items():
      check_fits(leaf.path, key[1].shape, dtype)
      data[key] = aligned_zeros(key[1].shape, dtype)

    async def one(got: list):
      hull = _hull([b for _, b in got])
      grant = await limiter.acquire(hull.size * dtype.itemsize)
      try:
        if len(got) == 1:  # straight into the buffer
          (key, b), = got
          await leaf.read_into(b, data[key][b.relative_to(key[1])])
          return
        tmp = np.empty(hull.shape, dtype)  # one fetch for several boxes
        await leaf.read_into(hull, tmp)
        for key, b in got:
          np.copyto(data[key][b.relative_to(key[1])], tmp[b.relative_to(hull)])
      finally:
        limiter.release(grant)

    await gather_or_cancel(*(one(got) for got in pieces.values()))
    placed, mine = {}, 0
    for key, devices in buffers.items():
      buf = data.pop(key)
      ints = buf.view(as_int).reshape((1,) + buf.shape)
      arrays = await put_on_devices(ints, devices)
      placed.update(zip(devices, arrays))
    for got in pieces.values():
      for key, b in got:
        mine += b.size * dtype.itemsize * len(buffers[key])
    index = self._local["index"]
    arr = jax.make_array_from_single_device_arrays(
        (self.r,) + self.shape, self.part_sharding,
        [placed[d] for d in index], dtype=as_int)
    return Part(arr, mine, ("sum", dtype.name))


def _hull(boxes: Sequence[Box]) -> Box:
  return Box(tuple(min(b.start[d] for b in boxes)
                   for d in range(len(boxes[0].start))),
             tuple(max(b.stop[d] for b in boxes)
                   for d in range(len(boxes[0].start))))


# ---- the exchange program -----------------------------------------------------

def _exchange(kinds, *parts):
  out = []
  for kind, x in zip(kinds, parts):
    if kind[0] == "sum":
      s = x.sum(axis=0, dtype=x.dtype)
      dtype = np.dtype(kind[1])
      out.append(s != 0 if dtype == np.bool_ else
                 jax.lax.bitcast_convert_type(s, dtype))
    else:
      out.append(x)
  return tuple(out)


def exchange_program(parts: Sequence[Part], shardings: Sequence[Any]
                     ) -> tuple[jax.Array, ...]:
  """One jit program: each part into its target sharding (all-gathers for
  even splits, all-reduces for chunk splits). A collective."""
  fn = jax.jit(_exchange, static_argnums=0, out_shardings=tuple(shardings))
  return fn(tuple(p.kind for p in parts), *(p.array for p in parts))
