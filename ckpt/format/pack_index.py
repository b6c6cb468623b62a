"""The index entry of a packed leaf (index version 2), and the tables that
say where its bytes are.

A small array leaf (ckpt/save/pack.py) is not a TensorStore array: each process
writes the boxes it owns of every small leaf, back to back, into a few
objects of its own, ``<step dir>/.packs/<process>.<k>.bin``, and records
where each box went in its table, ``<step dir>/.packs/<process>.msgpack``
(ckpt/format/pack_table.py: the leaf, the pack ``k``, the offset, the box and
its crc32c of each piece, as columns). ``leaf`` is the entry's position in
the index's leaves. The index entry
(kind "packed") records what a leaf is (shape, dtype, sharding), never where
it is: like the zarr v2 checksum files, nothing about it grows with the
number of processes, and no process waits for another's offsets. Every
name is built from integers checked here; none is read from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ckpt.format import checks
from ckpt.format import tree
from ckpt.errors import CorruptCheckpointError

PACK_DIR = ".packs"
KIND = "packed"
# Readers refuse more: a process's packs, each pack's bytes, a table's bytes.
MAX_PACKS = 1 << 16
MAX_PACK_BYTES = 1 << 32
MAX_TABLE_BYTES = 64 << 20
# A packed leaf's bytes (ckpt writes at most pack.MAX_LEAF_BYTES): bounds
# what checking that its pieces tile it costs a reader.
MAX_PACKED_LEAF_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class PackedEntry:
  """An array leaf whose boxes are in the processes' packs."""
  path: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: str
  source_dtype: str
  sharding: str = ""
  prng_impl: str = ""
  saved_sharding: Any = None  # index.SavedSharding | None, as ArrayEntry's
  # As ArrayEntry: never set (the tables hold the crc32c of each piece).
  checksums: tuple = ()

  @functools.cached_property
  def relpath(self) -> str:
    """The leaf's name as an array would have it (the save's tiling check
    keys leaves by it); nothing is stored under it."""
    return tree.storage_relpath(self.path)

  def to_json(self) -> dict[str, Any]:
    out = {"path": list(self.path), "kind": KIND, "shape": list(self.shape),
           "dtype": self.dtype, "source_dtype": self.source_dtype,
           "sharding": self.sharding}
    if self.prng_impl:
      out["prng_impl"] = self.prng_impl
    if self.saved_sharding is not None:
      out["saved_sharding"] = self.saved_sharding.to_json()
    return out


def pack_name(process: int, k: int) -> str:
  """``.packs/<process>.<k>.bin``, from checked integers."""
  _check_int(process, 1 << 20, "process number")
  _check_int(k, MAX_PACKS, "pack number")
  return f"{PACK_DIR}/{process}.{k}.bin"


def table_name(process: int) -> str:
  _check_int(process, 1 << 20, "process number")
  return f"{PACK_DIR}/{process}.msgpack"


def _check_int(v: Any, limit: int, what: str) -> None:
  if type(v) is not int or not 0 <= v < limit:
    raise CorruptCheckpointError(f"{what} {v!r} is not an int in [0, {limit})")


def decode_entry(e: dict, where: Any, path: tuple[str, ...]) -> PackedEntry:
  """A "packed" entry of an index, validated like an array's (shape,
  dtype, PRNG implementation, saved sharding); CorruptCheckpointError
  naming ``where``."""
  shape = checks.decode_shape(e.get("shape"), where)
  dtype = e.get("dtype")
  itemsize = checks.decode_dtype(dtype, where).itemsize
  nbytes = 1
  for d in shape:
    nbytes *= d
  if nbytes * itemsize > MAX_PACKED_LEAF_BYTES:
    raise checks.bad(where, f"a packed leaf of at most {MAX_PACKED_LEAF_BYTES} "
                      "bytes", f"shape {list(shape)} of {nbytes * itemsize} bytes")
  source = e.get("source_dtype", dtype)
  checks.decode_dtype(source, where)
  sharding = e.get("sharding", "")
  if not isinstance(sharding, str):
    raise checks.bad(where, "sharding as a string", sharding)
  impl = checks.decode_prng_impl(e, where, shape, dtype, True)
  saved = e.get("saved_sharding")
  if saved is not None:
    saved = checks.decode_saved_sharding(saved, where, checks.keys_rank(shape, impl))
  return PackedEntry(path, shape, dtype, source, sharding, impl, saved)
