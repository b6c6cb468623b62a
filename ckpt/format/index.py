"""Stage 6: ``index.msgpack``, the one file that describes a checkpoint.

Written by process 0 after every process has written its data; read and
validated before a restore uses any of it. msgpack only (never pickle), with
bounded sizes; every path in it must be a plain relative path that stays
inside the step directory. Anything else raises CorruptCheckpointError.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from typing import Any

import msgpack
import numpy as np

from ckpt.format import index_codec
from ckpt.store import gcpause
from ckpt.format import saved_sharding as saved_sharding_lib
from ckpt.format import seal
from ckpt.format.saved_sharding import (HOST_REPLICATED, REPLICATED_HOST,
                                        REPLICATED_INLINE, SavedSharding)
from ckpt.format import tree
from ckpt.errors import CorruptCheckpointError, InvalidStateError
from ckpt.format.checks import (MAX_DEPTH, Where, bad,
                                check_numbered_structure, check_structure,
                                decode_int)
from ckpt.format.entries import (KINDS, KINDS_BY_CLASS, ArrayEntry, Entry,
                                 ValueEntry, check_held,
                                 decode_entry)

FORMAT_NAME = "ckpt"
# 6: an array may be "held_by" an earlier step's data directory, [step,
# "attempt-<hex>"] (a bucket's reuse_unchanged=True; entries.py).
# 5: "host_states", how many processes' host_state files the step holds (0:
# none: host_state() is None on any process count). Version 4: one file per
# saving process.
# 4: sealed (below). 2: the leaves as columns, repeated specs and path parts
# stored once (index_codec.py); leaves may be "packed" (pack_index.py).
# 3: in the tree structure a leaf is its number among the leaves, no longer
# {"leaf": "<path>"}, and a node is one list, [kind, (key, child)...]
# (ckpt/format/tree.py KEYED).
# 1: one map per leaf, arrays and values only. In memory (Index.structure)
# a leaf is its number whatever the version.
VERSION = 6
READ_VERSIONS = (1, 2, 3, 4, 5, 6)
HELD_FROM = 6  # held_by from this version on
# Indexes from this version on, and their steps' per-process files, end with
# a crc32c trailer (ckpt/format/seal.py).
SEALED_FROM = 4
# The index grows with the leaves only, never with the number of processes:
# no per-box checksums (zarr3/ocdbt chunks carry a crc32c codec, zarr v2
# boxes are in per-process files) and no per-process host_state (files too),
# so the same leaves saved by 1 or 4,096 processes differ by the 2 bytes of
# the process_count integer. Measured with save.make_index and encode (5-part
# names such as params/layer_12/attn/q/kernel, a 2x4 NamedSharding): 334 and
# 337 bytes per array leaf for 1,000 and 10,000 leaves in format zarr3 (318
# and 321 for zarr, whose codec map has no "checksum") in version 1; about 75
# of those were the leaf's place in the tree structure (its path again: a
# number since version 3), most of the rest its path (twice: parts and
# relpath) and sharding text. The saved sharding (saved_sharding,
# added since) costs 69 more bytes per leaf on a 2-axis mesh of auto axes,
# 99 with jax.make_mesh's explicit axis_types. So 32 MiB holds about 70,000
# to 99,000 such leaves (more with shorter names). Indexes written before kept ~20 bytes
# per box written and a blob per process, which at 4,096-way sharding and
# ~12,000 leaves passed this limit. Checked before the file is read
# (restore.read_index) and again here; encode refuses to write more.
MAX_INDEX_BYTES = 32 << 20
# No list or map of an index is longer (leaves, a dict's keys; in older
# indexes a leaf's checksummed boxes and host_state per process).
MAX_CONTAINER_LEN = 1 << 20
# msgpack nests at most 1024 containers deep (its fixed C stack): an index
# deeper than that fails to parse whatever the options say.
# A real index makes fewer than one list per 3 bytes (an older index's 1-D
# checksummed box [[a], [b], crc] is 3 lists in 10 bytes; a zarr v2
# checksum file's record [leaf, [a], [b], crc] 3 in 11) and one map per 8
# (a python-int leaf of version 1: entry, value and structure maps in 45
# bytes; fewer since); more is
# refused while decoding, so a hostile index costs at most about 25 bytes of
# python objects per byte (docs/untrusted.md).
_LISTS_PER_BYTE, _MAPS_PER_BYTE = 3, 8  # at most one per this many bytes


def saved_sharding_of(entry: Entry) -> SavedSharding:
  """The SavedSharding of any index entry (see its kinds)."""
  if entry.saved_sharding is not None:
    return entry.saved_sharding
  if isinstance(entry, ValueEntry):  # a numpy scalar is host numpy too
    host = entry.host or (isinstance(entry.value, np.generic) and
                          not entry.prng_impl)
    return REPLICATED_HOST if host else REPLICATED_INLINE
  if entry.sharding == HOST_REPLICATED:
    return REPLICATED_HOST
  return saved_sharding_lib.unknown(entry.sharding)


@dataclasses.dataclass(frozen=True)
class Index:
  step: int
  time: float
  storage_format: str
  process_count: int
  # The tree's shape (tree.encode_structure, version 3's form whatever the
  # version read): nodes as lists, leaves as numbers into ``leaves``
  # (tree.decode_structure rebuilds the tree).
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
  # How many processes' host_state files (HOST_STATE_DIR) the step holds:
  # 0 when it was saved without host_state (host_state() is None on any
  # process count); M when saved by M processes (or imported from an Orbax
  # step of M processes' per-process items). None in indexes written before
  # the field: then process_count (every process that saved wrote one).
  host_states: int | None = None
  # Saved only by time (temporary_time_saves); written only when True.
  temporary: bool = False
  # The version it was read as (written: VERSION); from SEALED_FROM on its
  # per-process files are sealed (``sealed``).
  version: int = VERSION

  @property
  def sealed(self) -> bool:
    """Whether this step's files end with a crc32c trailer (seal.py)."""
    return self.version >= SEALED_FROM


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
    raise bad(where, "custom_metadata as JSON text of at most "
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
    raise bad(where, "custom_metadata as a JSON object", v[:80])
  return v


# ---- per-process files of a step ------------------------------------------
# Each process writes its own small files into the attempt's directory
# before the "written" barrier, so they commit (and are deleted) with the
# data and nothing about them passes through the coordinator or the index:
#   <step dir>/.host_state/<process>.msgpack   its host_state (msgpack)
#   <step dir>/.checksums/<process>.msgpack    format "zarr" only: crc32c of
#                                              every box it wrote
#   <step dir>/.reuse/<process>.msgpack        reuse_unchanged=True: the
#                                              xxh3-128 of every chunk it
#                                              stored, bytes written/reused
#   <step dir>/.writers/<process>.msgpack      writer="process": the record
#                                              of what its writer wrote, by
#                                              which process 0's writer
#                                              commits (ckpt/commit/
#                                              through_storage.py)
# A leaf's directory never starts with "." (tree.storage_relpath escapes it,
# check_relpath refuses it), so these names cannot meet a leaf's array.
HOST_STATE_DIR = ".host_state"
CHECKSUMS_DIR = ".checksums"
REUSE_DIR = ".reuse"
WRITERS_DIR = ".writers"
# Process numbers read from an index beyond this are refused (file names are
# built from them).
MAX_PROCESSES = 1 << 20
# The largest per-process file written or read (storage.MAX_OBJECT_BYTES).
MAX_PROCESS_FILE_BYTES = 32 << 20


def host_state_count(v: Any, where: str) -> int:
  """An index's ``host_states``: an int in [0, MAX_PROCESSES]."""
  if type(v) is not int or not 0 <= v <= MAX_PROCESSES:
    raise bad(where, f"an int in [0, {MAX_PROCESSES}]", v)
  return v


def process_file(kind: str, process: int, step_dir: str = "") -> str:
  """``<step_dir>/<kind>/<process>.msgpack``: the name is built from a
  process number checked here, never read from a checkpoint."""
  if kind not in (HOST_STATE_DIR, CHECKSUMS_DIR, REUSE_DIR, WRITERS_DIR):
    raise ValueError(f"unknown per-process file kind {kind!r}")
  if type(process) is not int or not 0 <= process < MAX_PROCESSES:
    raise CorruptCheckpointError(
        f"process number {process!r} is not an int in [0, {MAX_PROCESSES})")
  rel = f"{kind}/{process}.msgpack"
  return f"{step_dir}/{rel}" if step_dir else rel


# ---- encode / decode the whole index ---------------------------------------

def encode(index: Index) -> bytes:
  """The bytes of ``index.msgpack`` (version VERSION); raises
  InvalidStateError for an index that readers would refuse."""
  with gcpause.paused():
    return _encode(index)


def _encode(index: Index) -> bytes:
  doc = {
      "format": FORMAT_NAME, "version": VERSION, "step": index.step,
      "time": index.time, "storage_format": index.storage_format,
      "process_count": index.process_count, "metrics": index.metrics,
      **({"temporary": True} if index.temporary else {}),  # optional
      "structure": index.structure,
      "leaves": None,
      "host_state": list(index.host_state) if index.host_state is not None else None,
  }
  if index.custom_metadata is not None:  # an optional field (no version bump)
    doc["custom_metadata"] = index.custom_metadata
  if index.host_states is not None:  # optional too
    doc["host_states"] = host_state_count(index.host_states, "host_states")
  # What decode() would refuse is not written: a checkpoint nobody can read.
  # Each limit decode enforces on the document's shape is checked here, on
  # process 0 before the commit, so the save fails instead.
  try:  # the structure's nodes, and its leaves: the leaves, each once,
    # each where tree.flatten puts it
    depth, lists, longest = check_numbered_structure(
        index.structure, "the tree structure", len(index.leaves),
        max_depth=_PACK_DEPTH)
    if depth > MAX_DEPTH:
      raise _over_limit(index, "tree depth", depth, MAX_DEPTH, "checks.MAX_DEPTH",
                        "Nest the state less deeply")
    placed = tree.leaf_paths(index.structure, len(index.leaves))
    if placed != [e.path for e in index.leaves]:  # each where flatten puts it
      i = next(i for i, e in enumerate(index.leaves) if e.path != placed[i])
      raise CorruptCheckpointError(
          f"the tree structure has leaf {i} at {tree.path_str(placed[i])!r}, "
          f"where leaf {i} of the leaves is "
          f"{tree.path_str(index.leaves[i].path)!r} (the leaves must be in "
          "tree.flatten's order)")
  except CorruptCheckpointError as err:
    raise InvalidStateError(
        f"the index of step {index.step} would be refused by readers: "
        f"{err}") from err
  try:  # checks each array spec's extent (once per distinct spec)
    doc["leaves"] = index_codec.encode(index.leaves, KINDS_BY_CLASS)
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
  data = seal.seal(data)
  # (the leaves map counted once per map: a later save's is the last one)
  more = index_codec.counted(doc["leaves"])
  check_encoded(data, {**doc, "structure": None, "leaves": None}, index,
                (lists + more[0], more[1], max(longest, more[2])))
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
      f"(ckpt.format.{name}). "
      + (hint or "Save fewer, larger leaves (or fewer inline values)"))


def check_encoded(data: bytes, doc: Any, index: "Index",
                  more: tuple[int, int, int] = (0, 0, 0)) -> None:
  """Raises InvalidStateError (naming the limit, what was found and the
  limit) if ``decode`` would refuse ``data``, packed from ``doc``, for its
  size or the number, length or nesting of its containers (``more``: the
  (lists, maps, longest) of a part left out of ``doc``)."""
  if len(data) > MAX_INDEX_BYTES:
    raise _over_limit(index, "the encoded size in bytes", len(data),
                      MAX_INDEX_BYTES, "index.MAX_INDEX_BYTES")
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
                      longest_found, longest, "index.MAX_CONTAINER_LEN")
  if lists > budget.lists:
    raise _over_limit(index, f"the number of lists in {len(data)} bytes "
                      f"(at most one per {_LISTS_PER_BYTE} bytes)",
                      lists, budget.lists, "index._LISTS_PER_BYTE")
  if maps > budget.maps:
    raise _over_limit(index, f"the number of maps in {len(data)} bytes "
                      f"(at most one per {_MAPS_PER_BYTE} bytes)",
                      maps, budget.maps, "index._MAPS_PER_BYTE")


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
  with gcpause.paused():
    return msgpack.unpackb(data, raw=False, strict_map_key=True,
                           list_hook=budget.list_hook,
                           object_hook=budget.object_hook, **limits)


def decode(data: bytes, where: str = "index.msgpack") -> Index:
  """Parses and validates an index; raises CorruptCheckpointError."""
  with gcpause.paused():
    return _decode(data, where)


def _numbered_structure(structure: Any, where: str, names: list[str],
                        unique: set[str]) -> Any:
  """A version 1 or 2 structure (leaves ``{"leaf": "<path>"}``), validated
  against the leaves' distinct ``names`` and converted to today's form
  (leaves by number)."""
  referenced = check_structure(structure, where)
  # names are distinct (above): as many and the same set is the same leaves
  if len(referenced) != len(names) or set(referenced) != unique:
    missing = sorted(set(referenced) - unique)
    extra = sorted(unique - set(referenced))
    raise CorruptCheckpointError(
        f"{where}: tree structure and leaves disagree; structure leaves "
        f"without an entry: {missing[:10]}, entries not in the structure: "
        f"{extra[:10]}")
  return tree.numbered(structure, {name: i for i, name in enumerate(names)})


def _decode(data: bytes, where: str) -> Index:
  if len(data) > MAX_INDEX_BYTES:
    raise CorruptCheckpointError(f"{where}: {len(data)} bytes is over the "
                                 f"{MAX_INDEX_BYTES} byte limit")
  body, found, want = seal.split(data)
  sealed = want is not None and found == want
  try:
    doc = unpack(body if sealed else data)
  except Exception as e:
    damaged = ("" if want is None or sealed else
               f"; its crc32c trailer records {want:#010x} but its bytes "
               f"have {found:#010x}: the index was damaged")
    raise CorruptCheckpointError(
        f"{where} is not a valid msgpack document (truncated or corrupt "
        f"index, or over ckpt's limits for an index?): {e}{damaged}") from e
  if not isinstance(doc, dict):
    raise bad(where, "a map", doc)
  if doc.get("format") != FORMAT_NAME:
    raise bad(where, f"format {FORMAT_NAME!r}", doc.get("format"))
  version = doc.get("version")
  if type(version) is not int or version not in READ_VERSIONS:
    raise bad(where, f"version {' or '.join(map(str, READ_VERSIONS))}",
               version)
  if (version >= SEALED_FROM) != sealed:
    raise CorruptCheckpointError(
        f"{where}: version {version} with{'' if sealed else 'out'} a crc32c "
        f"trailer; expected one exactly from version {SEALED_FROM} on: the "
        "index was damaged")
  step = decode_int(doc.get("step"), f"{where}: step")
  pc = decode_int(doc.get("process_count"), f"{where}: process_count")
  t = doc.get("time")
  if not isinstance(t, (int, float)):
    raise bad(where, "a numeric time", t)
  fmt = doc.get("storage_format")
  if fmt not in ("zarr", "zarr3", "ocdbt"):
    raise bad(where, "storage_format zarr, zarr3 or ocdbt", fmt)
  metrics = doc.get("metrics") or {}
  if not isinstance(metrics, dict) or not all(
      isinstance(k, str) and isinstance(v, (int, float)) for k, v in metrics.items()):
    raise bad(where, "metrics as a map of str to number", metrics)
  raw_leaves = doc.get("leaves")
  if version >= 2:
    leaves = index_codec.decode(raw_leaves, where, KINDS, bad, Where)
  elif not isinstance(raw_leaves, list):
    raise bad(where, "a list of leaves", raw_leaves)
  else:
    leaves = tuple(decode_entry(e, Where(where, i))
                   for i, e in enumerate(raw_leaves))
  if fmt == "zarr":
    for i, e in enumerate(leaves):
      if isinstance(e, ArrayEntry) and e.codec.get("checksum") == "crc32c":
        raise bad(f"{where}: leaf {i} ({tree.path_str(e.path)})",
                   "no checksum codec (format zarr v2 has none)", e.codec)
  if fmt != "ocdbt":
    for i, e in enumerate(leaves):
      if getattr(e, "ocdbt_group", None) is not None:
        raise bad(f"{where}: leaf {i} ({tree.path_str(e.path)})",
                   f"no ocdbt_group (format {fmt})", e.ocdbt_group)
  check_held(leaves, version >= HELD_FROM, step, where)
  names = [tree.path_str(e.path) for e in leaves]
  if len(unique := set(names)) != len(names):
    dups = sorted(n for n, k in collections.Counter(names).items() if k > 1)
    raise CorruptCheckpointError(f"{where}: duplicate leaf paths {dups[:10]}")
  structure = doc.get("structure")
  if version >= 3:
    check_numbered_structure(structure, where, len(leaves))
  else:
    structure = _numbered_structure(structure, where, names, unique)
  host_state = doc.get("host_state")
  if host_state is not None and (not isinstance(host_state, list) or not all(
      isinstance(b, bytes) for b in host_state)):
    raise bad(where, "host_state as a list of msgpack blobs, one per process",
               host_state)
  return Index(step=step, time=float(t), storage_format=fmt, process_count=pc,
               structure=structure, leaves=leaves, metrics=dict(metrics),
               host_state=tuple(host_state) if host_state is not None else None,
               custom_metadata=_decode_custom_metadata(
                   doc.get("custom_metadata"), where), version=version,
               host_states=None if doc.get("host_states") is None else
               host_state_count(doc["host_states"], f"{where}: host_states"),
               temporary=_temporary(doc.get("temporary", False), where))


def _temporary(v: Any, where: str) -> bool:
  if type(v) is not bool:
    raise bad(where, "temporary as true or false", v)
  return v


