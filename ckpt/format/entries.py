"""The entries of an index, one per leaf: ``ArrayEntry`` (a stored
TensorStore array), ``ValueEntry`` (a value inline in the index) and
``PackedEntry`` (ckpt/format/pack_index.py); decoding and validating one
entry of a version-1 map (``_entry_of``), and the kinds of entry of a
version-2 index (``KINDS``, see ckpt/format/index_codec.py).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import numpy as np

from ckpt.format import index_codec
from ckpt.format import pack_index
from ckpt.format import saved_sharding as saved_sharding_lib
from ckpt.format import tree
from ckpt.format.checks import (bad, decode_dtype, keys_rank, plain_part,
                                decode_prng_impl, decode_shape, check_extent,
                                check_relpath, decode_saved_sharding)
from ckpt.format.inline_values import decode_value, encode_value
from ckpt.store import ocdbt
from ckpt.errors import CorruptCheckpointError


@dataclasses.dataclass(frozen=True)
class ArrayEntry:
  """A leaf stored as a TensorStore array under ``relpath``."""
  path: tuple[str, ...]
  relpath: str
  shape: tuple[int, ...]
  dtype: str
  chunks: tuple[int, ...]
  # {"compression": None | "zstd", "level": int, "checksum": "crc32c"}: the
  # checksum codec of zarr3/ocdbt arrays (absent in older indexes: none).
  codec: dict[str, Any]
  source_dtype: str
  sharding: str = ""
  # Older indexes only: (start, stop, crc32c) of every box written. Now
  # zarr3/ocdbt chunks carry their crc32c (codec) and zarr v2 boxes are
  # checksummed in per-process files (CHECKSUMS_DIR), so the index does not
  # grow with the number of processes.
  checksums: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...] = ()
  # A typed PRNG key leaf: the array is its key data, this its
  # implementation's name (ckpt/format/prng.py); "" for any other leaf.
  prng_impl: str = ""
  # Format "ocdbt", a step too large for one merge: the merge group whose
  # database holds the array (ckpt/store/ocdbt.py); None: the step's database.
  ocdbt_group: int | None = None
  # The sharding it was saved in, as a mesh and a PartitionSpec (kind
  # "mesh" or "device"); None in older indexes and for shardings that are
  # not recorded (see SavedSharding). ``sharding`` keeps the text.
  saved_sharding: "saved_sharding_lib.SavedSharding | None" = None
  # Index version 6, a bucket's reuse_unchanged=True: the array (its
  # metadata and every chunk) is the one under ``relpath`` in the data
  # directory of an earlier step, ``(step, "attempt-<hex>")``, instead of
  # this step's (ckpt/save/reuse.py). None: this step's own.
  held_by: tuple[int, str] | None = None

  def to_json(self) -> dict[str, Any]:
    out = {"path": list(self.path), "kind": "array", "relpath": self.relpath,
           "shape": list(self.shape), "dtype": self.dtype,
           "chunks": list(self.chunks), "codec": self.codec,
           "source_dtype": self.source_dtype, "sharding": self.sharding}
    if self.checksums:  # only indexes written before checksum files had them
      out["checksums"] = [[list(a), list(b), c] for a, b, c in self.checksums]
    if self.prng_impl:  # absent otherwise: older indexes decode unchanged
      out["prng_impl"] = self.prng_impl
    if self.ocdbt_group is not None:
      out["ocdbt_group"] = self.ocdbt_group
    if self.saved_sharding is not None:  # absent otherwise (older indexes)
      out["saved_sharding"] = self.saved_sharding.to_json()
    if self.held_by is not None:  # version 6 only
      out["held_by"] = list(self.held_by)
    return out


@dataclasses.dataclass(frozen=True)
class ValueEntry:
  """A leaf stored inline in the index (scalars, strings, tiny arrays)."""
  path: tuple[str, ...]
  value: Any  # the decoded python / numpy value
  prng_impl: str = ""  # as in ArrayEntry: ``value`` is then the key data
  # A small replicated jax.Array: the sharding it was saved in, as in
  # ArrayEntry (its mesh and PartitionSpec()); None for other values.
  saved_sharding: "saved_sharding_lib.SavedSharding | None" = None
  # Saved from a host numpy array: a jax target without a sharding gets it
  # back as numpy, as saved (absent: a jax.Array's, or an older index's).
  host: bool = False

  def to_json(self) -> dict[str, Any]:
    out = {"path": list(self.path), "kind": "value",
           "value": encode_value(self.value, self.path)}
    if self.prng_impl:
      out["prng_impl"] = self.prng_impl
    if self.saved_sharding is not None:  # absent otherwise (older indexes)
      out["saved_sharding"] = self.saved_sharding.to_json()
    if self.host:  # absent otherwise (older indexes)
      out["host"] = True
    return out


Entry = ArrayEntry | ValueEntry | pack_index.PackedEntry


def decode_entry(e: Any, where: str) -> Entry:
  if not isinstance(e, dict):
    raise bad(where, "a map", e)
  path = e.get("path")
  if not isinstance(path, list) or not all(isinstance(p, str) for p in path):
    raise bad(where, "path as a list of strings", path)
  path = tuple(path)
  where.path = path
  return _entry_of(e, path, where)


def _entry_of(e: dict, path: tuple[str, ...], where: Any) -> Entry:
  """The entry of a version-1 map ``e`` (a version-2 spec with its leaf's
  fields), validated, at ``path``."""
  if e.get("kind") == "value":
    value = decode_value(e.get("value"), where)
    impl = "" if e.get("prng_impl", "") == "" else decode_prng_impl(
        e, where, np.shape(value),
        getattr(value, "dtype", type(value).__name__),
        isinstance(value, np.ndarray))
    saved = e.get("saved_sharding")
    if saved is not None:
      if not isinstance(value, (np.ndarray, np.generic)):
        raise bad(where, "no saved_sharding (a python value)", saved)
      saved = decode_saved_sharding(saved, where, keys_rank(
          np.shape(value), impl))
    host = e.get("host", False)
    if host is not False and (host is not True or saved is not None or impl
                              or not isinstance(value, np.ndarray)):
      raise bad(where, "host absent, or true on a numpy array value with "
                 "no saved_sharding and no prng_impl", host)
    return ValueEntry(path, value, impl, saved, host)
  if e.get("kind") != "array":
    raise bad(where, "kind 'array' or 'value'", e.get("kind"))
  relpath = e.get("relpath")
  check_relpath(relpath, where)
  shape = decode_shape(e.get("shape"), where)
  chunks = decode_shape(e.get("chunks"), where)
  if len(chunks) != len(shape) or any(c < 1 for c in chunks):
    raise bad(where, f"{len(shape)} positive chunk extents", chunks)
  dtype = e.get("dtype")
  check_extent(shape, chunks, decode_dtype(dtype, where).itemsize, where)
  source = e.get("source_dtype", dtype)
  decode_dtype(source, where)
  codec = e.get("codec") or {}
  if not isinstance(codec, dict) or codec.get("compression") not in (None, "zstd"):
    raise bad(where, "codec compression None or 'zstd'", codec)
  if codec.get("checksum", "none") not in ("none", "crc32c"):
    raise bad(where, "codec checksum absent, 'none' or 'crc32c'", codec)
  sharding = e.get("sharding", "")
  if not isinstance(sharding, str):
    raise bad(where, "sharding as a string", sharding)
  sums = e.get("checksums", [])
  if not isinstance(sums, list):
    raise bad(where, "checksums as a list", sums)
  checksums = []
  for item in sums:
    if (not isinstance(item, list) or len(item) != 3 or type(item[2]) is not int
        or not 0 <= item[2] < 2**32):
      raise bad(where, "a checksum [start, stop, crc32c]", item)
    start, stop = decode_shape(item[0], where), decode_shape(item[1], where)
    if (len(start) != len(shape) or len(stop) != len(shape) or
        any(not a < b <= n for a, b, n in zip(start, stop, shape))):
      raise bad(where, f"a checksummed box inside shape {shape}", item)
    checksums.append((start, stop, item[2]))
  impl = decode_prng_impl(e, where, shape, dtype, True)
  group = e.get("ocdbt_group")
  if group is not None and (type(group) is not int or
                            not 0 <= group < ocdbt.MAX_GROUPS):
    raise bad(where, f"ocdbt_group an int in [0, {ocdbt.MAX_GROUPS})",
               group)
  saved = e.get("saved_sharding")
  if saved is not None:
    saved = decode_saved_sharding(saved, where, keys_rank(shape, impl))
  return ArrayEntry(path, relpath, shape, dtype, chunks, codec, source, sharding,
                    tuple(checksums), prng_impl=impl, ocdbt_group=group,
                    saved_sharding=saved,
                    held_by=decode_held_by(e.get("held_by"), where))


# The data directory a ``held_by`` names: a bucket's attempt directory only
# (ckpt/commit/records.py ATTEMPT_DIR_RE): never a path read from a checkpoint.
_HELD_DIR_RE = re.compile(r"^attempt-[0-9a-f]{1,64}$")


def decode_held_by(v: Any, where: Any) -> tuple[int, str] | None:
  """An array's ``held_by`` read from an index: None, or ``[step,
  "attempt-<hex>"]`` (the index checks that the step is an earlier one)."""
  if v is None:
    return None
  if (not isinstance(v, list) or len(v) != 2 or type(v[0]) is not int
      or not 0 <= v[0] < 2**63 or not isinstance(v[1], str)
      or not _HELD_DIR_RE.match(v[1])):
    raise bad(where, 'held_by as [step, "attempt-<hex>"]', v)
  return v[0], v[1]


def check_held(leaves, allowed: bool, step: int, where: str) -> None:
  """``held_by`` only where the version allows it (6 on), and only naming
  an earlier step: never the step itself or a later one."""
  for i, e in enumerate(leaves):
    held = getattr(e, "held_by", None)
    if held is not None and (not allowed or held[0] >= step):
      raise bad(f"{where}: leaf {i} ({tree.path_str(e.path)})",
                 f"held_by an earlier step than {step}, in an index of "
                 "version 6 or later", list(held))


def held_dir(held_by: tuple[int, str]) -> str:
  """The directory, relative to the root, that holds a ``held_by`` array:
  built from a step number and a checked attempt name, never read as a
  path."""
  step, data_dir = held_by
  if type(step) is not int or step < 0 or not _HELD_DIR_RE.match(data_dir):
    raise CorruptCheckpointError(f"held_by {held_by!r} is not a step's data "
                                 "directory")
  return f"checkpoint_{step}/{data_dir}"


# ---- the kinds of entry in a version-2 index (ckpt/format/index_codec.py) --------

def _with_path(template: Entry, **fields: Any) -> Entry:
  """``template`` (validated) with its per-leaf fields: the frozen
  dataclass's fields copied, not re-checked by __init__ per leaf."""
  out = object.__new__(type(template))
  state = template.__dict__.copy()
  state.update(fields)
  object.__setattr__(out, "__dict__", state)
  return out


def _array_decoder(spec: dict, where: Any) -> index_codec.Builder:
  template = _entry_of({**spec, "relpath": "_"}, (), where)

  def build(path: tuple[str, ...], leaf: tuple, where: Any) -> Entry:
    relpath, held = leaf
    if relpath is None:  # the one its path gives, each part checked once
      relpath = "/".join(map(_stored_part, path)) if path else "_root"
      if len(relpath) > 4096:
        raise bad(where, "a relative path of at most 4096 characters",
                   relpath)
    else:
      check_relpath(relpath, where)
    if held is None:
      return _with_path(template, path=path, relpath=relpath)
    return _with_path(template, path=path, relpath=relpath,
                      held_by=decode_held_by(held, where))
  return build


@functools.lru_cache(maxsize=1 << 16)
def _stored_part(p: str) -> str:
  """The directory of path part ``p`` (tree.storage_relpath's), checked as
  check_relpath checks a part read from an index."""
  part = tree.storage_relpath((p,))
  if not plain_part(part):
    raise CorruptCheckpointError(f"path part {p!r} stored as {part!r} is "
                                 "not a plain relative path part")
  return part


def _value_decoder(spec: dict, where: Any) -> index_codec.Builder:
  if spec.keys() <= {"kind"}:  # a plain value: no key, no sharding
    return lambda path, leaf, where: ValueEntry(
        path, decode_value(leaf[0], where))
  return lambda path, leaf, where: _entry_of({**spec, "value": leaf[0]},
                                             path, where)


def _packed_decoder(spec: dict, where: Any) -> index_codec.Builder:
  template = pack_index.decode_entry(spec, where, ())
  return lambda path, leaf, where: dataclasses.replace(template, path=path)


def _array_spec(e: ArrayEntry) -> dict:
  """An array's spec; refuses (CorruptCheckpointError) an extent that
  readers would refuse."""
  check_extent(e.shape, e.chunks, np.dtype(e.dtype).itemsize,
               f"leaf {tree.path_str(e.path)!r}")
  return _spec_of(e, "relpath", "held_by")


def _spec_of(e: Entry, *leaf_fields: str) -> dict:
  out = e.to_json()
  for name in ("path", "kind", *leaf_fields):
    out.pop(name, None)
  return out


KINDS = {k.name: k for k in (
    index_codec.Kind(
        "array", ArrayEntry, ("relpath", "held_by"),
        key=lambda e: (e.shape, e.dtype, e.chunks, tuple(e.codec.items()),
                       e.source_dtype, e.sharding, e.checksums, e.prng_impl,
                       e.ocdbt_group, e.saved_sharding),
        spec=_array_spec,
        # the relpath of nearly every leaf is the one its path gives
        leaf=lambda e: (None if e.relpath == tree.storage_relpath(e.path)
                        else e.relpath,
                        None if e.held_by is None else list(e.held_by)),
        decoder=_array_decoder),
    index_codec.Kind(
        "value", ValueEntry, ("value",),
        key=lambda e: (e.prng_impl, e.saved_sharding, e.host),
        spec=lambda e: _spec_of(e, "value"),
        leaf=lambda e: (encode_value(e.value, e.path),),
        decoder=_value_decoder),
    index_codec.Kind(
        pack_index.KIND, pack_index.PackedEntry, (),
        key=lambda e: (e.shape, e.dtype, e.source_dtype, e.sharding,
                       e.prng_impl, e.saved_sharding),
        spec=_spec_of, leaf=lambda e: (), decoder=_packed_decoder),
)}
KINDS_BY_CLASS = {k.cls: k for k in KINDS.values()}
