"""Validation of untrusted index input, shared by every kind of entry
(ckpt/format/index.py, its version-2 kinds in ckpt/format/entries.py, packed
entries in ckpt/format/pack_index.py): shapes, dtypes, PRNG key
implementations, relative paths, extents, the tree structure and saved
shardings, each refused with a CorruptCheckpointError naming where in the
index (``bad``), and the limits they check against.
"""

from __future__ import annotations

import collections
import functools
import math
import re
import reprlib
import urllib.parse
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy)
import numpy as np

from ckpt.format import prng
from ckpt.format import saved_sharding as saved_sharding_lib
from ckpt.format import tree
from ckpt.errors import CorruptCheckpointError

MAX_RANK = 64
MAX_DEPTH = 256
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
# Each allowed name's dtype, looked up once (not np.dtype() per leaf).
_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}
DTYPE_NAMES = {d: name for name, d in _DTYPES.items()}  # (dtype.name is slow)


def decode_saved_sharding(d: Any, where: Any, rank: int
                          ) -> saved_sharding_lib.SavedSharding:
  """A leaf's ``saved_sharding`` field, validated (CorruptCheckpointError
  naming ``where``); see saved_sharding.decode."""
  return saved_sharding_lib.decode(d, where, rank, bad)


def keys_rank(shape: tuple[int, ...], impl: str) -> int:
  """The rank a saved sharding is over: the keys' for key data."""
  return len(shape) - (len(prng.info(impl).key_shape) if impl else 0)


def decode_prng_impl(e: dict, where: str, shape: tuple[int, ...], dtype: Any,
               is_array: bool) -> str:
  """The entry's PRNG implementation ("" if none), checked against jax's
  implementations and against the key data it describes."""
  name = e.get("prng_impl", "")
  if name == "":
    return ""
  key = prng.info(name)
  if key is None:
    raise bad(where, "a PRNG implementation this jax knows (e.g. "
               "'threefry2x32', 'rbg')", name)
  k = len(key.key_shape)
  if (not is_array or np.dtype(dtype) != key.data_dtype or
      tuple(shape[len(shape) - k:]) != key.key_shape or len(shape) < k):
    raise bad(where, f"{name} key data ({key.data_dtype} with trailing "
               f"dimensions {key.key_shape})",
               f"{dtype} {'array' if is_array else 'value'} of shape {shape}")
  return name


def check_relpath(relpath: Any, where: str) -> str:
  """A path read from a checkpoint must stay inside the step directory."""
  if not isinstance(relpath, str) or not relpath or len(relpath) > 4096:
    raise bad(where, "a relative path", relpath)
  if not all(map(plain_part, relpath.split("/"))):
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
    raise bad(where, f"an array of at most {MAX_LEAF_BYTES} bytes",
               f"shape {list(shape)} of {nbytes} bytes")
  if any(c > max(s, 1) for s, c in zip(shape, chunks)):
    raise bad(where, f"chunks no larger than the shape {list(shape)}",
               list(chunks))
  chunk_bytes = math.prod(chunks) * itemsize
  if chunk_bytes > MAX_CHUNK_BYTES:
    raise bad(where, f"chunks of at most {MAX_CHUNK_BYTES} bytes",
               f"chunks {list(chunks)} of {chunk_bytes} bytes")
  count = math.prod(-(-s // c) for s, c in zip(shape, chunks))
  if count > MAX_CHUNKS:
    raise bad(where, f"at most {MAX_CHUNKS} chunks",
               f"{count} chunks of {list(chunks)} in shape {list(shape)}")


def check_structure(structure: Any, where: str) -> list[str]:
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
      raise bad(where, "a structure node map", node)
    if "leaf" in node:
      if not isinstance(node["leaf"], str):
        raise bad(where, "a leaf name", node["leaf"])
      add(node["leaf"])
      continue
    kind = node.get("node")
    if kind not in ("none", "dict", "list", "tuple", "object"):
      raise bad(where, "a node kind", kind)
    children = node.get("children", [])
    if not isinstance(children, list):
      raise bad(where, "a list of children", children)
    if kind in ("dict", "object"):
      keys = node.get("keys")
      if not isinstance(keys, list) or len(keys) != len(children):
        raise bad(where, f"{len(children)} keys", keys)
      key_types = (str, int) if kind == "dict" else (str,)
      if not set(map(type, keys)) <= set(key_types):
        raise bad(where, f"{kind} keys of type "
                   f"{' or '.join(t.__name__ for t in key_types)}", keys)
    for c in children:  # the common case here: a leaf
      if (depth < MAX_DEPTH and type(c) is dict and len(c) == 1 and
          type(c.get("leaf")) is str):
        add(c["leaf"])
      else:
        push((c, depth + 1))
  return leaves


def check_numbered_structure(structure: Any, where: str, n: int,
                              max_depth: int = MAX_DEPTH
                              ) -> tuple[int, int, int]:
  """Validates a tree structure of index version 3 (tree.KEYED): each node
  a list of its kind and its (key and) children, each leaf its number
  among the index's ``n`` leaves. The depth limit as check_structure's (a
  leaf one level below its node), and every number in range(n) exactly
  once. One loop over the nodes, a level of the tree at a time (100,000
  leaves are about as many nodes). Returns (depth, lists, longest): its
  depth, and the lists it packs to (its nodes; no maps) and the longest's
  length, as msgpack counts them."""
  numbers: list[int] = []
  add = numbers.append
  level, depth, lists, longest = [structure], 0, 0, 0
  while level:
    if depth > max_depth:
      raise CorruptCheckpointError(f"{where}: tree deeper than {max_depth}")
    below: list = []
    extend = below.extend
    leaves = len(numbers)
    for node in level:
      if type(node) is int:
        add(node)
        continue
      if type(node) is not list or not node:
        raise bad(where, "a structure node (a list: its kind, then its "
                   "children) or a leaf number", node)
      if len(node) > longest:
        longest = len(node)
      kind = node[0]
      if kind == "dict":
        if not len(node) % 2:
          raise bad(where, "a dict node's keys and children in pairs",
                     node)
        if not _DICT_KEYS.issuperset(map(type, node[1::2])):
          raise bad(where, "dict keys of type str or int", node[1::2])
        extend(node[2::2])
      elif kind in _SEQUENCES:
        extend(node[1:])
      elif kind == "object":
        if len(node) % 2 or type(node[1]) is not str:
          raise bad(where, "an object node's type name, then its keys and "
                     "children in pairs", node)
        if not _OBJECT_KEYS.issuperset(map(type, node[2::2])):
          raise bad(where, "object keys of type str", node[2::2])
        extend(node[3::2])
      elif kind != "none" or len(node) != 1:
        raise bad(where, "a node kind (dict, list, tuple, object, or none "
                   "with no children)", node)
    lists += len(level) - (len(numbers) - leaves)
    level = below
    depth += 1
  # As many numbers as leaves, each in range(n) and none twice: each leaf
  # once (checked in C; the report only on failure).
  if (len(numbers) != n or (numbers and (min(numbers) < 0 or
                                         max(numbers) >= n))
      or len(set(numbers)) != n):
    seen = set(numbers)
    dups = sorted(i for i, k in collections.Counter(numbers).items() if k > 1)
    raise CorruptCheckpointError(
        f"{where}: tree structure and leaves disagree: expected the leaf "
        f"numbers 0 to {n - 1} each once, found {len(numbers)} numbers; "
        f"out of range: {sorted(i for i in seen if not 0 <= i < n)[:10]}, "
        f"more than once: {dups[:10]}, missing: "
        f"{[i for i in range(n) if i not in seen][:10]}")
  return depth - 1, lists, longest


_SEQUENCES = ("list", "tuple")
_DICT_KEYS = frozenset({str, int})
_OBJECT_KEYS = frozenset({str})


def decode_int(v: Any, where: str) -> int:
  if type(v) is not int or v < 0:
    raise bad(where, "a non-negative int", v)
  return v


def decode_shape(v: Any, where: str) -> tuple[int, ...]:
  if (not isinstance(v, list) or len(v) > MAX_RANK or
      not all(type(d) is int and 0 <= d < 2**62 for d in v)):
    raise bad(where, f"a shape (list of at most {MAX_RANK} non-negative ints)", v)
  return tuple(v)


def decode_dtype(name: Any, where: str) -> np.dtype:
  dtype = _DTYPES.get(name) if isinstance(name, str) else None
  if dtype is None:
    raise bad(where, "a known dtype name", name)
  return dtype


class Where:
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
def plain_part(p: str) -> bool:
  """A part of a relative path that names a directory inside its parent:
  of a fixed character set, not starting with "."; percent escapes only
  as tree.storage_relpath writes them when they spell ".", "..", an empty
  name or a separator (which it writes for such keys: "%2E%2E" for a key
  "..", a literal name on every kvstore driver; "%2e%2e", ".%2E" or
  "..%2F" it never writes, and a layer that decoded them would step out)."""
  if not _REL_PART.match(p) or p in (".", ".."):
    return False
  if "%" not in p:
    return True
  text = urllib.parse.unquote(p)
  return (tree.storage_relpath((text,)) == p or not (
      text in ("", ".", "..") or any(c in text for c in "/\\\x00")))


# Errors show a bounded excerpt of what was found: repr() of a hostile
# 30-million-element list alone takes seconds and gigabytes.
SHORT_REPR = reprlib.Repr()
SHORT_REPR.maxlevel, SHORT_REPR.maxlist = 3, 12
SHORT_REPR.maxdict, SHORT_REPR.maxtuple = 8, 12
SHORT_REPR.maxstring = SHORT_REPR.maxother = SHORT_REPR.maxlong = 200


def bad(where: str, expected: str, found: Any) -> CorruptCheckpointError:
  text = SHORT_REPR.repr(found)
  if len(text) > 200:
    text = text[:200] + "..."
  return CorruptCheckpointError(f"{where}: expected {expected}, found {text}")
