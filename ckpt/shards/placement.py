"""Where a leaf's data lives, as one process needs it for planning.

``placement(sharding, shape, process)`` turns a jax sharding into a
``plan.Placement``: the grid unit, the smallest per-holder share of a
replicated box, and this process's boxes with the processes that hold each.

For a ``NamedSharding`` (what jit, ``device_put`` and partitioners produce)
this is computed from the mesh, never from ``devices_indices_map``: a box
is given by a device's mesh coordinates along the axes the spec uses, and
the processes holding the same box are those along the other axes. The
per-mesh part (process of every mesh position, this process's positions) is
computed once per mesh; a leaf then costs O(its local devices). Other
shardings fall back to ``devices_indices_map`` (O(devices), cached by jax
per sharding and shape).

``MeshInfo`` is plain data (numpy arrays and tuples), so the scale harness
(scripts/scale_plan.py) can describe a 16,384-device job that this machine
does not have and time exactly the code a save runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Hashable, Sequence

import numpy as np

from ckpt.shards import plan as plan_lib

Axes = tuple[tuple[str, ...], ...]  # per array dimension, the mesh axes


@dataclasses.dataclass(eq=False)
class MeshInfo:
  """A mesh as one process sees it: the process at every mesh position, and
  this process's devices with their positions."""
  axis_names: tuple[str, ...]
  procs: np.ndarray                         # mesh-shaped process indices
  local: tuple[tuple[Hashable, tuple[int, ...]], ...]  # (device id, position)

  def __post_init__(self):
    self._holders: dict[frozenset, tuple[dict, int]] = {}
    self._placements: dict[tuple, plan_lib.Placement] = {}

  @property
  def sizes(self) -> dict[str, int]:
    return dict(zip(self.axis_names, self.procs.shape))

  def holders(self, used: frozenset) -> tuple[dict, int]:
    """({local position: processes holding the box that position holds},
    the most processes holding any one box), for a spec using ``used``."""
    got = self._holders.get(used)
    if got is not None:
      return got
    keep = [i for i, a in enumerate(self.axis_names) if a in used]
    rest = [i for i, a in enumerate(self.axis_names) if a not in used]
    groups = np.transpose(self.procs, keep + rest).reshape(
        math.prod(self.procs.shape[i] for i in keep), -1)
    ordered = np.sort(groups, axis=1)
    distinct = 1 + (np.diff(ordered, axis=1) != 0).sum(axis=1)
    by_pos = {}
    for _, pos in self.local:
      if pos not in by_pos:
        sl = tuple(pos[i] if i in keep else slice(None)
                   for i in range(len(pos)))
        by_pos[pos] = tuple(int(p) for p in np.unique(self.procs[sl]))
    got = (by_pos, int(distinct.max()) if distinct.size else 1)
    self._holders[used] = got
    return got

  def named(self, axes: Axes, shape: tuple[int, ...]
            ) -> plan_lib.Placement | None:
    """The Placement of a NamedSharding-like layout (None: the shape does
    not divide evenly, so the generic path decides); cached per mesh."""
    key = (axes, shape)
    got = self._placements.get(key)
    if got is None:
      got = _named(self, axes, shape)
      if got is not None:
        self._placements[key] = got
    return got


def mesh_info(mesh: Any, process: int) -> MeshInfo:
  """The MeshInfo of a ``jax.sharding.Mesh`` for ``process`` (cached)."""
  return _mesh_info(mesh, process)


@functools.lru_cache(maxsize=64)
def _mesh_info(mesh, process: int) -> MeshInfo:
  devices = mesh.devices
  return make_mesh_info(
      tuple(mesh.axis_names),
      np.vectorize(lambda d: d.id, otypes=[np.int64])(devices),
      np.vectorize(lambda d: d.process_index, otypes=[np.int64])(devices),
      process)


def make_mesh_info(axis_names: Sequence[str], device_ids: np.ndarray,
                   procs: np.ndarray, process: int) -> MeshInfo:
  """A MeshInfo from mesh-shaped arrays of device ids and their processes
  (a real mesh's, or a simulated job's)."""
  if device_ids.shape != procs.shape or len(axis_names) != procs.ndim:
    raise ValueError(f"mesh axes {tuple(axis_names)}, device ids of shape "
                     f"{device_ids.shape} and processes of shape "
                     f"{procs.shape} do not match")
  local = tuple((int(device_ids[pos]), tuple(int(i) for i in pos))
                for pos in zip(*np.nonzero(procs == process)))
  return MeshInfo(tuple(axis_names), procs, local)


@functools.lru_cache(maxsize=4096)
def spec_axes(spec: tuple, ndim: int) -> Axes | None:
  """Per dimension, the mesh axes of a PartitionSpec (None: not a plain
  spec, e.g. UNCONSTRAINED, so the caller takes the generic path)."""
  if len(spec) > ndim:
    return None
  out = []
  for entry in tuple(spec) + (None,) * (ndim - len(spec)):
    if entry is None:
      out.append(())
    elif isinstance(entry, str):
      out.append((entry,))
    elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
      out.append(entry)
    else:
      return None
  return tuple(out)


def _named(info: MeshInfo, axes: Axes, shape: tuple[int, ...]
           ) -> plan_lib.Placement | None:
  """MeshInfo.named, uncached."""
  sizes = info.sizes
  index = {a: i for i, a in enumerate(info.axis_names)}
  ways = [math.prod(sizes[a] for a in dim) for dim in axes]
  if any(w == 0 or n % w for n, w in zip(shape, ways)):
    return None
  tile = tuple(n // w for n, w in zip(shape, ways))
  by_pos, most = info.holders(frozenset(a for dim in axes for a in dim))
  local: dict[plan_lib.Box, plan_lib.LocalShard] = {}
  for device, pos in info.local:
    start = []
    for dim, t in zip(axes, tile):
      part = 0
      for a in dim:  # the first axis is the most significant
        part = part * sizes[a] + pos[index[a]]
      start.append(part * t)
    box = plan_lib.Box(tuple(start), tuple(s + t for s, t in zip(start, tile)))
    have = local.get(box)
    if have is None or _device_key(device) < _device_key(have.device):
      local[box] = plan_lib.LocalShard(box, device, by_pos[pos])
  unit = tuple(math.gcd(t, n) or max(n, 1) for t, n in zip(tile, shape))
  size = math.prod(tile)
  return plan_lib.Placement(
      unit, size // most if most > 1 else None,
      tuple(sorted(local.values(), key=lambda s: s.box.start)))


def _device_key(device: Hashable):
  return (0, device) if isinstance(device, int) else (1, repr(device))


@functools.lru_cache(maxsize=64)
def _all_processes(n: int) -> tuple[int, ...]:
  return tuple(range(n))


def host_replicated(shape: tuple[int, ...], process: int, process_count: int
                    ) -> plan_lib.Placement:
  """A value every process holds whole (a host numpy array with no
  partitioner): every process is a holder of the one box."""
  box = plan_lib.Box((0,) * len(shape), tuple(shape))
  return plan_lib.Placement(
      tuple(max(n, 1) for n in shape),
      box.size // process_count if process_count > 1 else None,
      (plan_lib.LocalShard(box, None, _all_processes(process_count)),))


def placement(sharding: Any, shape: tuple[int, ...], process: int
              ) -> plan_lib.Placement:
  """The Placement of an array with this jax ``sharding``, for ``process``."""
  import jax  # pylint: disable=g-import-not-at-top
  shape = tuple(int(n) for n in shape)
  if isinstance(sharding, jax.sharding.NamedSharding):
    axes = spec_axes(tuple(sharding.spec), len(shape))
    if axes is not None:
      got = mesh_info(sharding.mesh, process).named(axes, shape)
      if got is not None:
        return got
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    (device,) = sharding.device_set
    box = plan_lib.Box((0,) * len(shape), shape)
    local = ((plan_lib.LocalShard(box, device.id, (device.process_index,)),)
             if device.process_index == process else ())
    return plan_lib.Placement(tuple(max(n, 1) for n in shape), None, local)
  index_map = {d.id: idx for d, idx in
               sharding.devices_indices_map(shape).items()}
  process_of = {d.id: d.process_index for d in sharding.device_set}
  shards = plan_lib.shards_from_index_map(shape, index_map, process_of)
  return plan_lib.placement_from_shards(shape, shards, process)
