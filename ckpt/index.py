"""Stage 6: ``index.msgpack``, the one file that describes a checkpoint.

Written by process 0 after every process has written its data; read and
validated before a restore uses any of it. msgpack only (never pickle), with
bounded sizes; every path in it must be a plain relative path that stays
inside the step directory. Anything else raises CorruptCheckpointError.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import math
import re
import reprlib
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy)
import msgpack
import numpy as np

from ckpt import prng
from ckpt import tree
from ckpt.errors import CorruptCheckpointError, InvalidStateError

FORMAT_NAME = "ckpt"
VERSION = 1
# A real index takes about 240 bytes per array leaf (one checksummed box; 190
# for the entry, 40 for its place in the tree structure) plus about 20 per
# further checksummed box: 100,000 leaves fit in 24 MiB. Checked before the
# file is read (restore.read_index) and again here; save refuses to write more.
MAX_INDEX_BYTES = 32 << 20
MAX_RANK = 64
MAX_DEPTH = 256
# No list or map of an index is longer (leaves, a dict's keys, a leaf's
# checksummed boxes, host_state per process).
MAX_CONTAINER_LEN = 1 << 20
# msgpack nests at most 1024 containers deep (its fixed C stack): an index
# deeper than that fails to parse whatever the options say.
# A real index makes fewer than one list per 3 bytes (a leaf's 1-D
# checksummed box [[a], [b], crc] is 3 lists in 10 bytes) and one map per 8
# (a python-int leaf: entry, value and structure maps in 45 bytes); more is
# refused while decoding, so a hostile index costs at most about 25 bytes of
# python objects per byte (README: "Reading checkpoints you did not write").
_LISTS_PER_BYTE, _MAPS_PER_BYTE = 3, 8  # at most one per this many bytes
# Array leaves: the elements a leaf may have (2**50, a PiB of bytes, far
# above any real leaf), chunks per leaf (a 64 TiB leaf in 1 MiB chunks) and
# the bytes of one chunk (ckpt writes at most 64 MiB; a reader decodes one
# whole chunk at a time, so this bounds what any single read decodes).
MAX_LEAF_BYTES = 1 << 50
MAX_CHUNKS = 1 << 26
MAX_CHUNK_BYTES = 1 << 30
_REL_PART = re.compile(r"^[A-Za-z0-9_\-%][A-Za-z0-9_.\-%]*$")
# Every one of these must be storable by TensorStore's zarr and zarr3 drivers
# (tests/test_checkpointer.py saves each); uint4 is not, so it is left out.
ALLOWED_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "float16", "float32", "float64", "bfloat16", "complex64",
    "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e4m3b11fnuz", "int4",
})


@dataclasses.dataclass(frozen=True)
class ArrayEntry:
  """A leaf stored as a TensorStore array under ``relpath``."""
  path: tuple[str, ...]
  relpath: str
  shape: tuple[int, ...]
  dtype: str
  chunks: tuple[int, ...]
  codec: dict[str, Any]
  source_dtype: str
  sharding: str = ""
  # (start, stop, crc32c) of every box written, taken of the staged bytes.
  checksums: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...] = ()
  # A typed PRNG key leaf: the array is its key data, this its
  # implementation's name (ckpt/prng.py); "" for any other leaf.
  prng_impl: str = ""

  def to_json(self) -> dict[str, Any]:
    out = {"path": list(self.path), "kind": "array", "relpath": self.relpath,
           "shape": list(self.shape), "dtype": self.dtype,
           "chunks": list(self.chunks), "codec": self.codec,
           "source_dtype": self.source_dtype, "sharding": self.sharding,
           "checksums": [[list(a), list(b), c] for a, b, c in self.checksums]}
    if self.prng_impl:  # absent otherwise: older indexes decode unchanged
      out["prng_impl"] = self.prng_impl
    return out


@dataclasses.dataclass(frozen=True)
class ValueEntry:
  """A leaf stored inline in the index (scalars, strings, tiny arrays)."""
  path: tuple[str, ...]
  value: Any  # the decoded python / numpy value
  prng_impl: str = ""  # as in ArrayEntry: ``value`` is then the key data

  def to_json(self) -> dict[str, Any]:
    out = {"path": list(self.path), "kind": "value",
           "value": encode_value(self.value, self.path)}
    if self.prng_impl:
      out["prng_impl"] = self.prng_impl
    return out


Entry = ArrayEntry | ValueEntry


@dataclasses.dataclass(frozen=True)
class Index:
  step: int
  time: float
  storage_format: str
  process_count: int
  structure: Any
  leaves: tuple[Entry, ...]
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  host_state: tuple[bytes, ...] | None = None  # msgpack, one per process


# ---- inline values ---------------------------------------------------------

def encode_value(v: Any, path: tuple[str, ...]) -> dict[str, Any]:
  if isinstance(v, (bool, int, float, str, bytes)) and not isinstance(v, np.generic):
    # Subclasses (IntEnum, StrEnum, ...) are stored as their base type, which
    # is all decode_value accepts.
    kind = next(t for t in (bool, int, float, str, bytes) if isinstance(v, t))
    v = kind.__str__(v) if kind is str else kind(v)
    if kind is int and not -2**63 <= v < 2**64:
      raise InvalidStateError(
          f"leaf {tree.path_str(path)!r}: int {v} does not fit in 64 bits")
    return {"py": kind.__name__, "v": v}
  arr = np.asarray(v)
  if arr.dtype.name not in ALLOWED_DTYPES:
    raise InvalidStateError(
        f"leaf {tree.path_str(path)!r}: dtype {arr.dtype} cannot be stored; "
        f"expected one of {sorted(ALLOWED_DTYPES)}")
  if not arr.dtype.isnative:  # the bytes are read back as native (little) endian
    arr = arr.astype(arr.dtype.newbyteorder("="))
  return {"np": arr.dtype.name, "shape": list(arr.shape),
          "scalar": isinstance(v, np.generic),
          "data": np.ascontiguousarray(arr).tobytes()}


def decode_value(d: Any, where: str) -> Any:
  if not isinstance(d, dict):
    raise _bad(where, "an inline value map", d)
  if "py" in d:
    kinds = {"bool": bool, "int": int, "float": float, "str": str, "bytes": bytes}
    kind = kinds.get(d["py"]) if isinstance(d["py"], str) else None
    v = d.get("v")
    if kind is None or type(v) is not kind and not (kind is float and type(v) is int):
      raise _bad(where, "a bool, int, float, str or bytes value", d)
    return kind(v)
  dtype = _dtype(d.get("np"), where)
  shape = _shape(d.get("shape"), where)
  data = d.get("data")
  if not isinstance(data, bytes) or len(data) != math.prod(shape) * dtype.itemsize:
    raise _bad(where, f"{math.prod(shape) * dtype.itemsize} data bytes",
               f"{len(data) if isinstance(data, bytes) else type(data).__name__}")
  arr = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
  return arr[()] if d.get("scalar") is True else arr


# ---- encode / decode the whole index ---------------------------------------

def encode(index: Index) -> bytes:
  doc = {
      "format": FORMAT_NAME, "version": VERSION, "step": index.step,
      "time": index.time, "storage_format": index.storage_format,
      "process_count": index.process_count, "metrics": index.metrics,
      "structure": index.structure,
      "leaves": [e.to_json() for e in index.leaves],
      "host_state": list(index.host_state) if index.host_state is not None else None,
  }
  data = msgpack.packb(doc, use_bin_type=True)
  # What decode() would refuse is not written: a checkpoint nobody can read.
  if len(data) > MAX_INDEX_BYTES or len(index.leaves) > MAX_CONTAINER_LEN:
    raise InvalidStateError(
        f"the index of step {index.step} would be {len(data)} bytes for "
        f"{len(index.leaves)} leaves; readers accept at most {MAX_INDEX_BYTES} "
        f"bytes and {MAX_CONTAINER_LEN} leaves (ckpt.index.MAX_INDEX_BYTES). "
        "Save fewer, larger leaves (or fewer inline values)")
  return data


class _ContainerBudget:
  """msgpack list/object hooks that refuse more containers than a real
  index of this many bytes holds (see _LISTS_PER_BYTE)."""

  def __init__(self, nbytes: int):
    self.lists = nbytes // _LISTS_PER_BYTE + 64
    self.maps = nbytes // _MAPS_PER_BYTE + 64

  def list_hook(self, x: list) -> list:
    self.lists -= 1
    if self.lists < 0:
      raise ValueError("more lists than a real index of this size holds")
    return x

  def object_hook(self, x: dict) -> dict:
    self.maps -= 1
    if self.maps < 0:
      raise ValueError("more maps than a real index of this size holds")
    return x


def unpack(data: bytes) -> Any:
  """msgpack-decodes an index with bounded lengths and container counts.

  Lengths are checked by msgpack before it allocates (a 5-byte header can
  declare 4 billion elements); the cyclic GC is paused meanwhile, as msgpack
  advises (it would rescan the growing document again and again).
  """
  budget = _ContainerBudget(len(data))
  limits = dict(max_str_len=MAX_INDEX_BYTES, max_bin_len=MAX_INDEX_BYTES,
                max_array_len=min(MAX_CONTAINER_LEN, len(data)),
                max_map_len=min(MAX_CONTAINER_LEN, len(data)), max_ext_len=0)
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    return msgpack.unpackb(data, raw=False, strict_map_key=True,
                           list_hook=budget.list_hook,
                           object_hook=budget.object_hook, **limits)
  finally:
    if was_enabled:
      gc.enable()


def decode(data: bytes, where: str = "index.msgpack") -> Index:
  """Parses and validates an index; raises CorruptCheckpointError."""
  if len(data) > MAX_INDEX_BYTES:
    raise CorruptCheckpointError(f"{where}: {len(data)} bytes is over the "
                                 f"{MAX_INDEX_BYTES} byte limit")
  try:
    doc = unpack(data)
  except Exception as e:
    raise CorruptCheckpointError(
        f"{where} is not a valid msgpack document (truncated or corrupt "
        f"index, or over ckpt's limits for an index?): {e}") from e
  if not isinstance(doc, dict):
    raise _bad(where, "a map", doc)
  if doc.get("format") != FORMAT_NAME:
    raise _bad(where, f"format {FORMAT_NAME!r}", doc.get("format"))
  if doc.get("version") != VERSION:
    raise _bad(where, f"version {VERSION}", doc.get("version"))
  step = _int(doc.get("step"), f"{where}: step")
  pc = _int(doc.get("process_count"), f"{where}: process_count")
  t = doc.get("time")
  if not isinstance(t, (int, float)):
    raise _bad(where, "a numeric time", t)
  fmt = doc.get("storage_format")
  if fmt not in ("zarr", "zarr3", "ocdbt"):
    raise _bad(where, "storage_format zarr, zarr3 or ocdbt", fmt)
  metrics = doc.get("metrics") or {}
  if not isinstance(metrics, dict) or not all(
      isinstance(k, str) and isinstance(v, (int, float)) for k, v in metrics.items()):
    raise _bad(where, "metrics as a map of str to number", metrics)
  raw_leaves = doc.get("leaves")
  if not isinstance(raw_leaves, list):
    raise _bad(where, "a list of leaves", raw_leaves)
  leaves = tuple(_decode_entry(e, f"{where}: leaf {i}")
                 for i, e in enumerate(raw_leaves))
  names = [tree.path_str(e.path) for e in leaves]
  if len(set(names)) != len(names):
    dups = sorted(n for n, k in collections.Counter(names).items() if k > 1)
    raise CorruptCheckpointError(f"{where}: duplicate leaf paths {dups[:10]}")
  structure = doc.get("structure")
  _check_structure(structure, where)
  referenced = list(tree.iter_structure_leaves(structure))
  if sorted(referenced) != sorted(names):
    missing = sorted(set(referenced) - set(names))
    extra = sorted(set(names) - set(referenced))
    raise CorruptCheckpointError(
        f"{where}: tree structure and leaves disagree; structure leaves "
        f"without an entry: {missing[:10]}, entries not in the structure: "
        f"{extra[:10]}")
  host_state = doc.get("host_state")
  if host_state is not None and (not isinstance(host_state, list) or not all(
      isinstance(b, bytes) for b in host_state)):
    raise _bad(where, "host_state as a list of msgpack blobs, one per process",
               host_state)
  return Index(step=step, time=float(t), storage_format=fmt, process_count=pc,
               structure=structure, leaves=leaves, metrics=dict(metrics),
               host_state=tuple(host_state) if host_state is not None else None)


def _decode_entry(e: Any, where: str) -> Entry:
  if not isinstance(e, dict):
    raise _bad(where, "a map", e)
  path = e.get("path")
  if not isinstance(path, list) or not all(isinstance(p, str) for p in path):
    raise _bad(where, "path as a list of strings", path)
  path = tuple(path)
  where = f"{where} ({tree.path_str(path)})"
  if e.get("kind") == "value":
    value = decode_value(e.get("value"), where)
    impl = "" if e.get("prng_impl", "") == "" else _prng_impl(
        e, where, np.shape(value),
        getattr(value, "dtype", type(value).__name__),
        isinstance(value, np.ndarray))
    return ValueEntry(path, value, impl)
  if e.get("kind") != "array":
    raise _bad(where, "kind 'array' or 'value'", e.get("kind"))
  relpath = e.get("relpath")
  check_relpath(relpath, where)
  shape = _shape(e.get("shape"), where)
  chunks = _shape(e.get("chunks"), where)
  if len(chunks) != len(shape) or any(c < 1 for c in chunks):
    raise _bad(where, f"{len(shape)} positive chunk extents", chunks)
  dtype = _dtype(e.get("dtype"), where).name
  check_extent(shape, chunks, np.dtype(dtype).itemsize, where)
  source = e.get("source_dtype", dtype)
  _dtype(source, where)
  codec = e.get("codec") or {}
  if not isinstance(codec, dict) or codec.get("compression") not in (None, "zstd"):
    raise _bad(where, "codec compression None or 'zstd'", codec)
  sharding = e.get("sharding", "")
  if not isinstance(sharding, str):
    raise _bad(where, "sharding as a string", sharding)
  sums = e.get("checksums", [])
  if not isinstance(sums, list):
    raise _bad(where, "checksums as a list", sums)
  checksums = []
  for item in sums:
    if (not isinstance(item, list) or len(item) != 3 or type(item[2]) is not int
        or not 0 <= item[2] < 2**32):
      raise _bad(where, "a checksum [start, stop, crc32c]", item)
    start, stop = _shape(item[0], where), _shape(item[1], where)
    if (len(start) != len(shape) or len(stop) != len(shape) or
        any(not a < b <= n for a, b, n in zip(start, stop, shape))):
      raise _bad(where, f"a checksummed box inside shape {shape}", item)
    checksums.append((start, stop, item[2]))
  impl = _prng_impl(e, where, shape, dtype, True)
  return ArrayEntry(path, relpath, shape, dtype, chunks, codec, source, sharding,
                    tuple(checksums), prng_impl=impl)


def _prng_impl(e: dict, where: str, shape: tuple[int, ...], dtype: Any,
               is_array: bool) -> str:
  """The entry's PRNG implementation ("" if none), checked against jax's
  implementations and against the key data it describes."""
  name = e.get("prng_impl", "")
  if name == "":
    return ""
  key = prng.info(name)
  if key is None:
    raise _bad(where, "a PRNG implementation this jax knows (e.g. "
               "'threefry2x32', 'rbg')", name)
  k = len(key.key_shape)
  if (not is_array or np.dtype(dtype) != key.data_dtype or
      tuple(shape[len(shape) - k:]) != key.key_shape or len(shape) < k):
    raise _bad(where, f"{name} key data ({key.data_dtype} with trailing "
               f"dimensions {key.key_shape})",
               f"{dtype} {'array' if is_array else 'value'} of shape {shape}")
  return name


def check_relpath(relpath: Any, where: str) -> str:
  """A path read from a checkpoint must stay inside the step directory."""
  if not isinstance(relpath, str) or not relpath or len(relpath) > 4096:
    raise _bad(where, "a relative path", relpath)
  parts = relpath.split("/")
  if any(not _REL_PART.match(p) or p in (".", "..") for p in parts):
    raise CorruptCheckpointError(
        f"{where}: path {relpath!r} is not a plain relative path inside the "
        "checkpoint (absolute, '..', or unexpected characters); refusing it")
  return relpath


def check_extent(shape: tuple[int, ...], chunks: tuple[int, ...],
                 itemsize: int, where: str) -> None:
  """An array leaf's size, chunk count and chunk size stay within what any
  real checkpoint has, computed in python ints (no overflow), before
  anything is opened or allocated."""
  nbytes = math.prod(shape) * itemsize
  if nbytes > MAX_LEAF_BYTES:
    raise _bad(where, f"an array of at most {MAX_LEAF_BYTES} bytes",
               f"shape {list(shape)} of {nbytes} bytes")
  if any(c > max(s, 1) for s, c in zip(shape, chunks)):
    raise _bad(where, f"chunks no larger than the shape {list(shape)}",
               list(chunks))
  chunk_bytes = math.prod(chunks) * itemsize
  if chunk_bytes > MAX_CHUNK_BYTES:
    raise _bad(where, f"chunks of at most {MAX_CHUNK_BYTES} bytes",
               f"chunks {list(chunks)} of {chunk_bytes} bytes")
  count = math.prod(-(-s // c) for s, c in zip(shape, chunks))
  if count > MAX_CHUNKS:
    raise _bad(where, f"at most {MAX_CHUNKS} chunks",
               f"{count} chunks of {list(chunks)} in shape {list(shape)}")


def _check_structure(node: Any, where: str, depth: int = 0) -> None:
  if depth > MAX_DEPTH:
    raise CorruptCheckpointError(f"{where}: tree deeper than {MAX_DEPTH}")
  if not isinstance(node, dict):
    raise _bad(where, "a structure node map", node)
  if "leaf" in node:
    if not isinstance(node["leaf"], str):
      raise _bad(where, "a leaf name", node["leaf"])
    return
  kind = node.get("node")
  if kind not in ("none", "dict", "list", "tuple", "object"):
    raise _bad(where, "a node kind", kind)
  children = node.get("children", [])
  if not isinstance(children, list):
    raise _bad(where, "a list of children", children)
  if kind in ("dict", "object"):
    keys = node.get("keys")
    if not isinstance(keys, list) or len(keys) != len(children):
      raise _bad(where, f"{len(children)} keys", keys)
    key_types = (str, int) if kind == "dict" else (str,)
    if not all(type(k) in key_types for k in keys):
      raise _bad(where, f"{kind} keys of type "
                 f"{' or '.join(t.__name__ for t in key_types)}", keys)
  for c in children:
    _check_structure(c, where, depth + 1)


def _int(v: Any, where: str) -> int:
  if type(v) is not int or v < 0:
    raise _bad(where, "a non-negative int", v)
  return v


def _shape(v: Any, where: str) -> tuple[int, ...]:
  if (not isinstance(v, list) or len(v) > MAX_RANK or
      not all(type(d) is int and 0 <= d < 2**62 for d in v)):
    raise _bad(where, f"a shape (list of at most {MAX_RANK} non-negative ints)", v)
  return tuple(v)


def _dtype(name: Any, where: str) -> np.dtype:
  if not isinstance(name, str) or name not in ALLOWED_DTYPES:
    raise _bad(where, "a known dtype name", name)
  return np.dtype(name)


# Errors show a bounded excerpt of what was found: repr() of a hostile
# 30-million-element list alone takes seconds and gigabytes.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxtuple = 3, 12, 8, 12
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 200


def _bad(where: str, expected: str, found: Any) -> CorruptCheckpointError:
  text = _REPR.repr(found)
  if len(text) > 200:
    text = text[:200] + "..."
  return CorruptCheckpointError(f"{where}: expected {expected}, found {text}")
