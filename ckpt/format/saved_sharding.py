"""The sharding a leaf was saved in, as the index records it.

``SavedSharding`` is what ``Metadata.shardings`` holds and what a restore
builds for a target leaf without a sharding (``restore.AsSaved``): a mesh's
axis names, sizes and types and a PartitionSpec over it (kind "mesh"), one
device ("device"), one value for the whole job ("replicated"), or nothing
recorded ("unknown"). ``decode`` validates the index field
``saved_sharding`` (docs/format.md, "On-disk layout"); ``ckpt/format/index.py`` holds the
entries that carry it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The text of an array leaf's ``sharding`` for a host numpy leaf saved
# without a partitioner, and Metadata's description of an inline leaf.
HOST_REPLICATED = "replicated (host value)"
INLINE = "inline (replicated)"
# A recorded mesh is refused beyond these (no real mesh comes near them).
MAX_MESH_AXES = 16
MAX_AXIS_NAME_LEN = 128
MAX_MESH_DEVICES = 1 << 24
AXIS_TYPES = ("auto", "explicit", "manual")  # jax.sharding.AxisType, lowered


@dataclasses.dataclass(frozen=True)
class SavedSharding:
  """Where a leaf was when it was saved (``Metadata.shardings``).

  ``kind``:
  - ``"mesh"``: a ``NamedSharding``: a mesh of ``axis_names`` with
    ``axis_sizes`` (and ``axis_types``, lower-case names of
    ``jax.sharding.AxisType``; empty: all auto) and ``spec`` over it;
  - ``"device"``: one device (a ``SingleDeviceSharding``);
  - ``"replicated"``: one value for the whole job, with no mesh: a host
    numpy leaf saved without a partitioner, or a small leaf kept inline;
  - ``"unknown"``: no mesh recorded: an index written before ckpt recorded
    them, or a sharding that is not a NamedSharding over named axes.

  ``description`` is the text the index keeps (what ``ckpt inspect`` and
  ``str()`` show). ``to_sharding(devices)`` builds it on this job's devices.
  """
  kind: str
  axis_names: tuple[str, ...] = ()
  axis_sizes: tuple[int, ...] = ()
  spec: PartitionSpec = PartitionSpec()
  axis_types: tuple[str, ...] = ()
  description: str = ""

  @property
  def mesh_shape(self) -> dict[str, int]:
    """``{axis name: size}`` of the saved mesh (empty without one)."""
    return dict(zip(self.axis_names, self.axis_sizes))

  @property
  def num_devices(self) -> int | None:
    """How many devices the saved mesh had (None: no mesh recorded)."""
    return {"mesh": math.prod(self.axis_sizes), "device": 1}.get(self.kind)

  def __str__(self) -> str:
    return self.description or self._text()

  def _text(self) -> str:
    if self.kind == "device":
      return "SingleDeviceSharding"
    if self.kind != "mesh":
      return self.kind
    text = f"NamedSharding(mesh={self.mesh_shape}, spec={tuple(self.spec)})"
    if any(t != "auto" for t in self.axis_types):
      text = text[:-1] + f", axis_types={self.axis_types})"
    return text

  def to_sharding(self, devices=None) -> jax.sharding.Sharding:
    """This sharding on ``devices`` (default: ``jax.devices()``, the same
    order on every process).

    ``"mesh"``: a ``NamedSharding`` over a mesh of the saved axis names,
    sizes and types; it needs exactly as many devices as the saved mesh
    had. With ``devices=None`` the mesh is ``jax.make_mesh``'s (the device
    order it picks for the topology; on CPU and GPU ``jax.devices()`` in
    order), else ``devices`` in the order given. ``"device"``: the first
    of them this process holds (each process its own, as saved).
    ``"replicated"``: replicated over all the devices. Raises
    ValueError (saying why) when it cannot be built, and for ``"unknown"``.
    """
    given = devices is not None
    devices = tuple(jax.devices() if devices is None else devices)
    if not devices:
      raise ValueError("no devices to build a sharding on")
    if self.kind == "device":  # this process's first (addressable) one
      here = jax.process_index()
      return jax.sharding.SingleDeviceSharding(next(
          (d for d in devices if d.process_index == here), devices[0]))
    if self.kind == "replicated":
      return NamedSharding(_mesh(("devices",), (len(devices),), (), devices,
                                 False), PartitionSpec())
    if self.kind != "mesh":
      raise ValueError(
          f"no mesh was recorded for this leaf (saved as {str(self)!r}: "
          "written by a ckpt that did not record meshes, or a sharding that "
          "is not a NamedSharding over named axes)")
    if len(devices) != self.num_devices:
      raise ValueError(
          f"the saved mesh {self.mesh_shape} has {self.num_devices} devices, "
          f"{'the devices given are' if given else 'this job has'} "
          f"{len(devices)}")
    return NamedSharding(_mesh(self.axis_names, self.axis_sizes,
                               self.axis_types, devices, given), self.spec)

  def to_json(self) -> dict[str, Any]:
    """The index field ``saved_sharding`` (kinds "mesh" and "device")."""
    if self.kind not in ("mesh", "device"):
      raise ValueError(f"a {self.kind!r} sharding is not stored as a mesh")
    out = {"mesh_axes": list(self.axis_names),
           "mesh_shape": list(self.axis_sizes),
           "spec": [p if p is None or isinstance(p, str) else list(p)
                    for p in self.spec]}
    if any(t != "auto" for t in self.axis_types):
      out["axis_types"] = list(self.axis_types)
    return out


@functools.lru_cache(maxsize=64)
def _mesh(names: tuple[str, ...], sizes: tuple[int, ...],
          types: tuple[str, ...], devices: tuple, given: bool) -> Mesh:
  kinds = tuple(getattr(jax.sharding.AxisType, t.capitalize())
                for t in (types or ("auto",) * len(names)))
  if not given:
    try:
      return jax.make_mesh(sizes, names, axis_types=kinds, devices=devices)
    except Exception:  # pylint: disable=broad-except
      pass  # a topology make_mesh cannot map (multi-slice): in order
  return Mesh(np.asarray(devices, dtype=object).reshape(sizes), names,
              axis_types=kinds)


# A value kept inline (or given in memory), a host numpy leaf saved
# without a partitioner: one value for the whole job, no mesh.
REPLICATED_INLINE = SavedSharding("replicated", description=INLINE)
REPLICATED_HOST = SavedSharding("replicated", description=HOST_REPLICATED)


@functools.lru_cache(maxsize=1024)
def unknown(text: str) -> SavedSharding:
  return SavedSharding("unknown", description=text)


def decode(d: Any, where: Any, rank: int,
           bad: Callable[[Any, str, Any], Exception]) -> SavedSharding:
  """Validates an index's ``saved_sharding`` of a leaf of ``rank``
  dimensions (the keys' rank for a PRNG key leaf): distinct non-empty axis
  names (strings), positive sizes, at most MAX_MESH_DEVICES devices, known
  axis types, and a spec of at most ``rank`` entries (each None, an axis
  name or a list of them) that uses only the mesh's axes, each once.
  ``bad(where, expected, found)``: the error to raise (checks.bad)."""
  if not isinstance(d, dict):
    raise bad(where, "saved_sharding as a map", d)
  names, sizes = d.get("mesh_axes"), d.get("mesh_shape")
  if (not isinstance(names, list) or len(names) > MAX_MESH_AXES or
      not all(isinstance(n, str) and 0 < len(n) <= MAX_AXIS_NAME_LEN
              for n in names) or len(set(names)) != len(names)):
    raise bad(where, f"saved_sharding mesh_axes as at most {MAX_MESH_AXES} "
               f"distinct axis names of 1 to {MAX_AXIS_NAME_LEN} characters",
               names)
  if (not isinstance(sizes, list) or len(sizes) != len(names) or
      not all(type(n) is int and 0 < n <= MAX_MESH_DEVICES for n in sizes)
      or math.prod(sizes) > MAX_MESH_DEVICES):
    raise bad(where, f"saved_sharding mesh_shape as {len(names)} positive "
               f"sizes of at most {MAX_MESH_DEVICES} devices in all", sizes)
  types = d.get("axis_types", ())
  if not isinstance(types, (list, tuple)) or (
      types and (len(types) != len(names) or
                 not all(isinstance(t, str) and t in AXIS_TYPES
                         for t in types))):
    raise bad(where, f"saved_sharding axis_types as {len(names)} of "
               f"{AXIS_TYPES}", types)
  spec = d.get("spec")
  if not isinstance(spec, list) or len(spec) > rank:
    raise bad(where, f"saved_sharding spec as a list of at most {rank} "
               "entries (the leaf's dimensions)", spec)
  used: list[str] = []
  for p in spec:
    axes = [] if p is None else [p] if isinstance(p, str) else p
    if not isinstance(axes, list) or not all(a in names for a in axes):
      raise bad(where, f"saved_sharding spec entries None, an axis of "
                 f"{names} or a list of them", p)
    used.extend(axes)
  if len(set(used)) != len(used):
    raise bad(where, "saved_sharding spec using each mesh axis once", spec)
  return _saved(tuple(names), tuple(sizes), tuple(types),
                tuple(p if p is None or isinstance(p, str) else tuple(p)
                      for p in spec))


@functools.lru_cache(maxsize=1024)
def _saved(names: tuple[str, ...], sizes: tuple[int, ...],
           types: tuple[str, ...], spec: tuple) -> SavedSharding:
  """One object per distinct saved sharding (an index of 100,000 leaves
  has a few): validated above, built here."""
  if all(t == "auto" for t in types):
    types = ()
  out = SavedSharding("mesh" if names else "device", names, sizes,
                      PartitionSpec(*spec), types)
  return dataclasses.replace(out, description=str(out))  # no description yet
