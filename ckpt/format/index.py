"""Stage 6: ``index.msgpack``, the one file that describes a checkpoint.

Written by process 0 after every process has written its data; read and
validated before a restore uses any of it. msgpack only (never pickle), with
bounded sizes; every path in it must be a plain relative path that stays
inside the step directory. Anything else raises CorruptCheckpointError.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import json
import math
import re
import reprlib
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy)
import msgpack
import numpy as np

from ckpt.format import index_codec
from ckpt.format import pack_index
from ckpt.format import prng
from ckpt.format import saved_sharding as saved_sharding_lib
from ckpt.format import tree
from ckpt.store import ocdbt
from ckpt.errors import CorruptCheckpointError, InvalidStateError

FORMAT_NAME = "ckpt"
# 2: the leaves as columns, repeated specs and path parts stored once
# (ckpt/format/index_codec.py); leaves may be "packed" (ckpt/format/pack_index.py).
# 1: one map per leaf, arrays and values only. Both are read.
VERSION = 2
READ_VERSIONS = (1, 2)
# The index grows with the leaves only, never with the number of processes:
# no per-box checksums (zarr3/ocdbt chunks carry a crc32c codec, zarr v2
# boxes are in per-process files) and no per-process host_state (files too),
# so the same leaves saved by 1 or 4,096 processes differ by the 2 bytes of
# the process_count integer. Measured with save.make_index and encode (5-part
# names such as params/layer_12/attn/q/kernel, a 2x4 NamedSharding): 334 and
# 337 bytes per array leaf for 1,000 and 10,000 leaves in format zarr3 (318
# and 321 for zarr, whose codec map has no "checksum"); about 75 of those are
# the leaf's place in the tree structure, most of the rest its path (twice:
# parts and relpath) and sharding text. The saved sharding (saved_sharding,
# added since) costs 69 more bytes per leaf on a 2-axis mesh of auto axes,
# 99 with jax.make_mesh's explicit axis_types. So 32 MiB holds about 70,000
# to 99,000 such leaves (more with shorter names). Indexes written before kept ~20 bytes
# per box written and a blob per process, which at 4,096-way sharding and
# ~12,000 leaves passed this limit. Checked before the file is read
# (restore.read_index) and again here; encode refuses to write more.
MAX_INDEX_BYTES = 32 << 20
MAX_RANK = 64
MAX_DEPTH = 256
# No list or map of an index is longer (leaves, a dict's keys; in older
# indexes a leaf's checksummed boxes and host_state per process).
MAX_CONTAINER_LEN = 1 << 20
# msgpack nests at most 1024 containers deep (its fixed C stack): an index
# deeper than that fails to parse whatever the options say.
# A real index makes fewer than one list per 3 bytes (an older index's 1-D
# checksummed box [[a], [b], crc] is 3 lists in 10 bytes; a zarr v2
# checksum file's record [leaf, [a], [b], crc] 3 in 11) and one map per 8
# (a python-int leaf: entry, value and structure maps in 45 bytes); more is
# refused while decoding, so a hostile index costs at most about 25 bytes of
# python objects per byte (docs/untrusted.md).
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
# The most OCDBT merge groups a step may have (defined in ckpt/store/ocdbt.py).
MAX_OCDBT_GROUPS = ocdbt.MAX_GROUPS
# Each allowed name's dtype, looked up once (not np.dtype() per leaf).
_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}
_DTYPE_NAMES = {d: name for name, d in _DTYPES.items()}  # (dtype.name is slow)


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
  saved_sharding: "SavedSharding | None" = None

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
    return out


@dataclasses.dataclass(frozen=True)
class ValueEntry:
  """A leaf stored inline in the index (scalars, strings, tiny arrays)."""
  path: tuple[str, ...]
  value: Any  # the decoded python / numpy value
  prng_impl: str = ""  # as in ArrayEntry: ``value`` is then the key data
  # A small replicated jax.Array: the sharding it was saved in, as in
  # ArrayEntry (its mesh and PartitionSpec()); None for other values.
  saved_sharding: "SavedSharding | None" = None

  def to_json(self) -> dict[str, Any]:
    out = {"path": list(self.path), "kind": "value",
           "value": encode_value(self.value, self.path)}
    if self.prng_impl:
      out["prng_impl"] = self.prng_impl
    if self.saved_sharding is not None:  # absent otherwise (older indexes)
      out["saved_sharding"] = self.saved_sharding.to_json()
    return out


PackedEntry = pack_index.PackedEntry
Entry = ArrayEntry | ValueEntry | PackedEntry


# ---- the sharding a leaf was saved in (ckpt/format/saved_sharding.py) ------------
HOST_REPLICATED = saved_sharding_lib.HOST_REPLICATED
INLINE = saved_sharding_lib.INLINE
MAX_MESH_AXES = saved_sharding_lib.MAX_MESH_AXES
SavedSharding = saved_sharding_lib.SavedSharding
REPLICATED_INLINE = saved_sharding_lib.REPLICATED_INLINE
REPLICATED_HOST = saved_sharding_lib.REPLICATED_HOST


def decode_saved_sharding(d: Any, where: Any, rank: int) -> SavedSharding:
  """A leaf's ``saved_sharding`` field, validated (CorruptCheckpointError
  naming ``where``); see saved_sharding.decode."""
  return saved_sharding_lib.decode(d, where, rank, _bad)


def saved_sharding_of(entry: Entry) -> SavedSharding:
  """The SavedSharding of any index entry (see its kinds)."""
  if entry.saved_sharding is not None:
    return entry.saved_sharding
  if isinstance(entry, ValueEntry):
    return REPLICATED_INLINE
  if entry.sharding == HOST_REPLICATED:
    return REPLICATED_HOST
  return saved_sharding_lib.unknown(entry.sharding)


@dataclasses.dataclass(frozen=True)
class Index:
  step: int
  time: float
  storage_format: str
  process_count: int
  structure: Any
  leaves: tuple[Entry, ...]
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  # Older indexes only: msgpack, one per process. Now each process writes
  # its own file (HOST_STATE_DIR) and this is None.
  host_state: tuple[bytes, ...] | None = None
  # save(custom_metadata=...) as JSON text (a dict); None when not given
  # (then the index has no such field: indexes written before it existed
  # and those without it read the same).
  custom_metadata: str | None = None


# The largest custom_metadata (JSON text) written or read; see
# save_extras.check_custom_metadata.
MAX_CUSTOM_METADATA_BYTES = 1 << 20


def custom_metadata_of(index: Index) -> dict:
  """The step's custom_metadata as a dict ({} when none was saved)."""
  return {} if index.custom_metadata is None else json.loads(
      index.custom_metadata)


def _decode_custom_metadata(v: Any, where: str) -> str | None:
  """An index's custom_metadata, untrusted: JSON text of a dict, within
  MAX_CUSTOM_METADATA_BYTES, finite numbers only."""
  if v is None:
    return None
  if not isinstance(v, str) or len(v.encode()) > MAX_CUSTOM_METADATA_BYTES:
    raise _bad(where, "custom_metadata as JSON text of at most "
               f"{MAX_CUSTOM_METADATA_BYTES} bytes",
               v if not isinstance(v, str) else f"{len(v.encode())} bytes")

  def no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")
  def finite(text: str) -> float:
    f = float(text)
    if not math.isfinite(f):
      raise ValueError(f"{text[:40]} is not a finite number")
    return f
  try:
    doc = json.loads(v, parse_constant=no_constant, parse_float=finite)
  except (ValueError, RecursionError) as e:
    raise CorruptCheckpointError(
        f"{where}: custom_metadata is not valid JSON: {e}") from None
  if not isinstance(doc, dict):
    raise _bad(where, "custom_metadata as a JSON object", v[:80])
  return v


# ---- per-process files of a step ------------------------------------------
# Each process writes its own small files into the attempt's directory
# before the "written" barrier, so they commit (and are deleted) with the
# data and nothing about them passes through the coordinator or the index:
#   <step dir>/.host_state/<process>.msgpack   its host_state (msgpack)
#   <step dir>/.checksums/<process>.msgpack    format "zarr" only: crc32c of
#                                              every box it wrote
# A leaf's directory never starts with "." (tree.storage_relpath escapes it,
# check_relpath refuses it), so these names cannot meet a leaf's array.
HOST_STATE_DIR = ".host_state"
CHECKSUMS_DIR = ".checksums"
# Process numbers read from an index beyond this are refused (file names are
# built from them).
MAX_PROCESSES = 1 << 20
# The largest per-process file written or read (storage.MAX_OBJECT_BYTES).
MAX_PROCESS_FILE_BYTES = 32 << 20


def process_file(kind: str, process: int, step_dir: str = "") -> str:
  """``<step_dir>/<kind>/<process>.msgpack``: the name is built from a
  process number checked here, never read from a checkpoint."""
  if kind not in (HOST_STATE_DIR, CHECKSUMS_DIR):
    raise ValueError(f"unknown per-process file kind {kind!r}")
  if type(process) is not int or not 0 <= process < MAX_PROCESSES:
    raise CorruptCheckpointError(
        f"process number {process!r} is not an int in [0, {MAX_PROCESSES})")
  rel = f"{kind}/{process}.msgpack"
  return f"{step_dir}/{rel}" if step_dir else rel


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
  name = _DTYPE_NAMES.get(arr.dtype) or arr.dtype.name
  if name not in ALLOWED_DTYPES:
    raise InvalidStateError(
        f"leaf {tree.path_str(path)!r}: dtype {arr.dtype} cannot be stored; "
        f"expected one of {sorted(ALLOWED_DTYPES)}")
  if not arr.dtype.isnative:  # the bytes are read back as native (little) endian
    arr = arr.astype(arr.dtype.newbyteorder("="))
  return {"np": name, "shape": list(arr.shape),
          "scalar": isinstance(v, np.generic),
          "data": np.ascontiguousarray(arr).tobytes()}


_PY_KINDS = {"bool": bool, "int": int, "float": float, "str": str,
             "bytes": bytes}


def decode_value(d: Any, where: str) -> Any:
  if not isinstance(d, dict):
    raise _bad(where, "an inline value map", d)
  if "py" in d:
    kind = _PY_KINDS.get(d["py"]) if isinstance(d["py"], str) else None
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

@contextlib.contextmanager
def _gc_paused():
  """The cyclic GC paused (as msgpack advises while unpacking): building
  an index's hundreds of thousands of objects would otherwise trigger
  collections that rescan them again and again (half the CPU time of
  decoding 100,000 leaves). Nothing built here is cyclic."""
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()


def encode(index: Index) -> bytes:
  """The bytes of ``index.msgpack`` (version VERSION); raises
  InvalidStateError for an index that readers would refuse."""
  with _gc_paused():
    return _encode(index)


def _encode(index: Index) -> bytes:
  doc = {
      "format": FORMAT_NAME, "version": VERSION, "step": index.step,
      "time": index.time, "storage_format": index.storage_format,
      "process_count": index.process_count, "metrics": index.metrics,
      "structure": index.structure,
      "leaves": None,
      "host_state": list(index.host_state) if index.host_state is not None else None,
  }
  if index.custom_metadata is not None:  # an optional field (no version bump)
    doc["custom_metadata"] = index.custom_metadata
  # What decode() would refuse is not written: a checkpoint nobody can read.
  # Each limit decode enforces on the document's shape is checked here, on
  # process 0 before the commit, so the save fails instead.
  try:
    depth, counts = index_codec.structure_walk(index.structure)
  except ValueError as e:
    raise InvalidStateError(
        f"the index of step {index.step} would not decode: {e}") from e
  if depth > MAX_DEPTH:
    raise _over_limit(index, "tree depth", depth, MAX_DEPTH, "MAX_DEPTH",
                      "Nest the state less deeply")
  try:  # checks each array spec's extent (once per distinct spec)
    doc["leaves"] = index_codec.encode(index.leaves, _KINDS_BY_CLASS)
  except CorruptCheckpointError as err:
    raise InvalidStateError(
        f"the index of step {index.step} would be refused by readers: "
        f"{err}") from err
  try:
    data = msgpack.packb(doc, use_bin_type=True)
  except ValueError as e:  # msgpack's own nesting limit
    raise InvalidStateError(
        f"the index of step {index.step} cannot be encoded: {e} (msgpack "
        f"nests at most {_PACK_DEPTH} containers)") from e
  check_encoded(data, {**doc, "structure": None}, index, counts)
  return data


# msgpack packs and unpacks at most this many nested containers (its
# recursion limit and fixed C stack): whatever packs, parses. The structure
# depth limit (MAX_DEPTH, two containers a level) keeps real indexes far
# below it.
_PACK_DEPTH = 1024


def _over_limit(index: "Index", what: str, found: int, limit: int,
                name: str, hint: str = "") -> InvalidStateError:
  n = len(index.leaves)
  return InvalidStateError(
      f"the index of step {index.step} ({n} leaves) would exceed a limit "
      f"that readers enforce, so nobody could read the checkpoint; nothing "
      f"was committed: {what} is {found}, the limit is {limit} "
      f"(ckpt.format.index.{name}). "
      + (hint or "Save fewer, larger leaves (or fewer inline values)"))


def check_encoded(data: bytes, doc: Any, index: "Index",
                  more: tuple[int, int, int] = (0, 0, 0)) -> None:
  """Raises InvalidStateError (naming the limit, what was found and the
  limit) if ``decode`` would refuse ``data``, packed from ``doc``, for its
  size or the number, length or nesting of its containers (``more``: the
  (lists, maps, longest) of a part left out of ``doc``)."""
  if len(data) > MAX_INDEX_BYTES:
    raise _over_limit(index, "the encoded size in bytes", len(data),
                      MAX_INDEX_BYTES, "MAX_INDEX_BYTES")
  try:
    lists, maps, longest_found = index_codec.containers(doc)
    lists, maps = lists + more[0], maps + more[1]
    longest_found = max(longest_found, more[2])
  except ValueError as e:
    raise InvalidStateError(
        f"the index of step {index.step} would not decode: {e}") from e
  budget = _ContainerBudget(len(data))
  longest = min(MAX_CONTAINER_LEN, len(data))
  if longest_found > longest:
    raise _over_limit(index, "the longest list or map (e.g. the leaves)",
                      longest_found, longest, "MAX_CONTAINER_LEN")
  if lists > budget.lists:
    raise _over_limit(index, f"the number of lists in {len(data)} bytes "
                      f"(at most one per {_LISTS_PER_BYTE} bytes)",
                      lists, budget.lists, "_LISTS_PER_BYTE")
  if maps > budget.maps:
    raise _over_limit(index, f"the number of maps in {len(data)} bytes "
                      f"(at most one per {_MAPS_PER_BYTE} bytes)",
                      maps, budget.maps, "_MAPS_PER_BYTE")


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
  with _gc_paused():
    return _decode(data, where)


def _decode(data: bytes, where: str) -> Index:
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
  version = doc.get("version")
  if type(version) is not int or version not in READ_VERSIONS:
    raise _bad(where, f"version {' or '.join(map(str, READ_VERSIONS))}",
               version)
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
  if version >= 2:
    leaves = index_codec.decode(raw_leaves, where, KINDS, _bad, _Where)
  elif not isinstance(raw_leaves, list):
    raise _bad(where, "a list of leaves", raw_leaves)
  else:
    leaves = tuple(_decode_entry(e, _Where(where, i))
                   for i, e in enumerate(raw_leaves))
  if fmt == "zarr":
    for i, e in enumerate(leaves):
      if isinstance(e, ArrayEntry) and e.codec.get("checksum") == "crc32c":
        raise _bad(f"{where}: leaf {i} ({tree.path_str(e.path)})",
                   "no checksum codec (format zarr v2 has none)", e.codec)
  if fmt != "ocdbt":
    for i, e in enumerate(leaves):
      if getattr(e, "ocdbt_group", None) is not None:
        raise _bad(f"{where}: leaf {i} ({tree.path_str(e.path)})",
                   f"no ocdbt_group (format {fmt})", e.ocdbt_group)
  names = [tree.path_str(e.path) for e in leaves]
  if len(unique := set(names)) != len(names):
    dups = sorted(n for n, k in collections.Counter(names).items() if k > 1)
    raise CorruptCheckpointError(f"{where}: duplicate leaf paths {dups[:10]}")
  structure = doc.get("structure")
  referenced = _check_structure(structure, where)
  # names are distinct (above): as many and the same set is the same leaves
  if len(referenced) != len(names) or set(referenced) != unique:
    missing = sorted(set(referenced) - unique)
    extra = sorted(unique - set(referenced))
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
               host_state=tuple(host_state) if host_state is not None else None,
               custom_metadata=_decode_custom_metadata(
                   doc.get("custom_metadata"), where))


def _decode_entry(e: Any, where: str) -> Entry:
  if not isinstance(e, dict):
    raise _bad(where, "a map", e)
  path = e.get("path")
  if not isinstance(path, list) or not all(isinstance(p, str) for p in path):
    raise _bad(where, "path as a list of strings", path)
  path = tuple(path)
  where.path = path
  return _entry_of(e, path, where)


def _entry_of(e: dict, path: tuple[str, ...], where: Any) -> Entry:
  """The entry of a version-1 map ``e`` (a version-2 spec with its leaf's
  fields), validated, at ``path``."""
  if e.get("kind") == "value":
    value = decode_value(e.get("value"), where)
    impl = "" if e.get("prng_impl", "") == "" else _prng_impl(
        e, where, np.shape(value),
        getattr(value, "dtype", type(value).__name__),
        isinstance(value, np.ndarray))
    saved = e.get("saved_sharding")
    if saved is not None:
      if not isinstance(value, (np.ndarray, np.generic)):
        raise _bad(where, "no saved_sharding (a python value)", saved)
      saved = decode_saved_sharding(saved, where, _keys_rank(
          np.shape(value), impl))
    return ValueEntry(path, value, impl, saved)
  if e.get("kind") != "array":
    raise _bad(where, "kind 'array' or 'value'", e.get("kind"))
  relpath = e.get("relpath")
  check_relpath(relpath, where)
  shape = _shape(e.get("shape"), where)
  chunks = _shape(e.get("chunks"), where)
  if len(chunks) != len(shape) or any(c < 1 for c in chunks):
    raise _bad(where, f"{len(shape)} positive chunk extents", chunks)
  dtype = e.get("dtype")
  check_extent(shape, chunks, _dtype(dtype, where).itemsize, where)
  source = e.get("source_dtype", dtype)
  _dtype(source, where)
  codec = e.get("codec") or {}
  if not isinstance(codec, dict) or codec.get("compression") not in (None, "zstd"):
    raise _bad(where, "codec compression None or 'zstd'", codec)
  if codec.get("checksum", "none") not in ("none", "crc32c"):
    raise _bad(where, "codec checksum absent, 'none' or 'crc32c'", codec)
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
  group = e.get("ocdbt_group")
  if group is not None and (type(group) is not int or
                            not 0 <= group < MAX_OCDBT_GROUPS):
    raise _bad(where, f"ocdbt_group an int in [0, {MAX_OCDBT_GROUPS})",
               group)
  saved = e.get("saved_sharding")
  if saved is not None:
    saved = decode_saved_sharding(saved, where, _keys_rank(shape, impl))
  return ArrayEntry(path, relpath, shape, dtype, chunks, codec, source, sharding,
                    tuple(checksums), prng_impl=impl, ocdbt_group=group,
                    saved_sharding=saved)


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
    relpath = leaf[0]
    if relpath is None:  # the one its path gives, each part checked once
      relpath = "/".join(map(_stored_part, path)) if path else "_root"
      if len(relpath) > 4096:
        raise _bad(where, "a relative path of at most 4096 characters",
                   relpath)
    else:
      check_relpath(relpath, where)
    return _with_path(template, path=path, relpath=relpath)
  return build


@functools.lru_cache(maxsize=1 << 16)
def _stored_part(p: str) -> str:
  """The directory of path part ``p`` (tree.storage_relpath's), checked as
  check_relpath checks a part read from an index."""
  part = tree.storage_relpath((p,))
  if not _plain_part(part):
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
  return _spec_of(e, "relpath")


def _spec_of(e: Entry, *leaf_fields: str) -> dict:
  out = e.to_json()
  for name in ("path", "kind", *leaf_fields):
    out.pop(name, None)
  return out


KINDS = {k.name: k for k in (
    index_codec.Kind(
        "array", ArrayEntry, ("relpath",),
        key=lambda e: (e.shape, e.dtype, e.chunks, tuple(e.codec.items()),
                       e.source_dtype, e.sharding, e.checksums, e.prng_impl,
                       e.ocdbt_group, e.saved_sharding),
        spec=_array_spec,
        # the relpath of nearly every leaf is the one its path gives
        leaf=lambda e: (None if e.relpath == tree.storage_relpath(e.path)
                        else e.relpath,),
        decoder=_array_decoder),
    index_codec.Kind(
        "value", ValueEntry, ("value",),
        key=lambda e: (e.prng_impl, e.saved_sharding),
        spec=lambda e: _spec_of(e, "value"),
        leaf=lambda e: (encode_value(e.value, e.path),),
        decoder=_value_decoder),
    index_codec.Kind(
        pack_index.KIND, PackedEntry, (),
        key=lambda e: (e.shape, e.dtype, e.source_dtype, e.sharding,
                       e.prng_impl, e.saved_sharding),
        spec=_spec_of, leaf=lambda e: (), decoder=_packed_decoder),
)}
_KINDS_BY_CLASS = {k.cls: k for k in KINDS.values()}


def _keys_rank(shape: tuple[int, ...], impl: str) -> int:
  """The rank a saved sharding is over: the keys' for key data."""
  return len(shape) - (len(prng.info(impl).key_shape) if impl else 0)


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
  if not all(map(_plain_part, relpath.split("/"))):
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


def _check_structure(structure: Any, where: str) -> list[str]:
  """Validates a tree structure; returns the names of its leaves (one
  loop over the nodes, no recursion: 100,000 leaves are 200,000 nodes)."""
  leaves: list[str] = []
  stack = [(structure, 0)]
  pop, push, add = stack.pop, stack.append, leaves.append
  while stack:
    node, depth = pop()
    if depth > MAX_DEPTH:
      raise CorruptCheckpointError(f"{where}: tree deeper than {MAX_DEPTH}")
    if not isinstance(node, dict):
      raise _bad(where, "a structure node map", node)
    if "leaf" in node:
      if not isinstance(node["leaf"], str):
        raise _bad(where, "a leaf name", node["leaf"])
      add(node["leaf"])
      continue
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
      if not set(map(type, keys)) <= set(key_types):
        raise _bad(where, f"{kind} keys of type "
                   f"{' or '.join(t.__name__ for t in key_types)}", keys)
    for c in children:  # the common case here: a leaf
      if (depth < MAX_DEPTH and type(c) is dict and len(c) == 1 and
          type(c.get("leaf")) is str):
        add(c["leaf"])
      else:
        push((c, depth + 1))
  return leaves


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
  dtype = _DTYPES.get(name) if isinstance(name, str) else None
  if dtype is None:
    raise _bad(where, "a known dtype name", name)
  return dtype


class _Where:
  """Where an entry is, for error messages: formatted only if one is
  raised (an index of 100,000 leaves decodes each entry once)."""

  def __init__(self, prefix: str, i: int):
    self.prefix, self.i, self.path = prefix, i, None

  def __str__(self) -> str:
    where = f"{self.prefix}: leaf {self.i}"
    return where if self.path is None else (
        f"{where} ({tree.path_str(self.path)})")

  __format__ = lambda self, spec: format(str(self), spec)


@functools.lru_cache(maxsize=1 << 16)
def _plain_part(p: str) -> bool:
  return bool(_REL_PART.match(p)) and p not in (".", "..")


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
