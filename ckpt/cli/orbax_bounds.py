"""The bounds an Orbax checkpoint is held to by ``ckpt import``: it is
untrusted input (docs/untrusted.md), read by ckpt/cli/orbax_import.py and
ckpt/cli/orbax_tree.py. Each refusal is an OrbaxImportError naming the file
and the problem.

- Names. A tree entry's keys, an item's name and every listed key become
  parts of kvstore keys. One that is empty, ``.`` or ``..``, or holds ``/``
  (or a NUL or backslash), is refused before anything is opened with it: on
  ``s3://`` the HTTP layer normalises ``/../`` in a request path, so
  ``<item>/../../victim`` would read another prefix of the bucket.
- Extents. An array's shape, dtype and chunks, as TensorStore opened them
  from its ``.zarray`` / ``zarr.json``: ckpt's own limits on a leaf
  (ckpt/format/checks.py: bytes, rank, chunk count), a dtype ckpt stores,
  and one chunk (decoded whole by a read) no larger than this host's memory.
  A ``scalar`` entry must hold one element (it is read whole).
- Meshes. A saved sharding's mesh within the limits of a ckpt index's
  (ckpt/format/saved_sharding.py).
- JSON. Files nest at most as deep as Python's parser allows (deeper is
  refused, not a RecursionError); JSON items and metrics at most
  ``MAX_JSON_DEPTH``.
- Sparse arrays. A missing chunk reads as the fill value and a compressed
  chunk expands, so a 96-byte ``.zarray`` can claim 4 TiB of zeros. The
  arrays of a source may claim at most ``SPARSE_FACTOR`` times the bytes
  the source stores, plus ``SPARSE_ALLOWANCE``, unless ``allow_sparse``:
  an import writes at most that, whatever its files claim. Stored bytes
  are exact on a disk (a stat per file); on a bucket (whose listing through
  TensorStore carries no sizes) a lower bound from one-byte ranged reads,
  at most a few per object and none once the bound is met.
"""

from __future__ import annotations

import math
import os
import stat
from typing import Any

import numpy as np

from ckpt.errors import OrbaxImportError
from ckpt.format import checks
from ckpt.format import saved_sharding
from ckpt.restore import hostmem

# What a source's arrays may claim: SPARSE_FACTOR times what it stores
# (zstd of real weights saves 5-30%; an array of zeros, such as a fresh
# optimizer state, compresses far more or is not stored at all, and is
# covered by the rest of the checkpoint), plus SPARSE_ALLOWANCE for a small
# checkpoint holding such an array. ``allow_sparse=True`` (``ckpt import
# --allow-sparse``) lifts the bound.
SPARSE_FACTOR = 64
SPARSE_ALLOWANCE = 256 << 20
# JSON items and metrics nest at most this deep (their values become
# ckpt tree nodes, which an index nests at most checks.MAX_DEPTH deep).
MAX_JSON_DEPTH = 128
# Ranged-read rounds of the lower bound on a bucket's stored bytes.
_PROBE_ROUNDS = 8
_BAD_CHARS = ("/", "\\", "\x00")


def check_key(key: Any, where: str, what: str = "key") -> str:
  """``key`` if it can be one part of a kvstore key: a non-empty string,
  not ``.`` or ``..``, holding no ``/``, backslash or NUL."""
  if (not isinstance(key, str) or key in ("", ".", "..") or
      any(c in key for c in _BAD_CHARS)):
    raise OrbaxImportError(
        f"{where}: {what} {key!r} is not a plain name (expected a non-empty "
        "string other than '.' and '..', without '/', '\\' or NUL); it would "
        "name a file outside its directory. Refusing the checkpoint before "
        "opening anything")
  return key


def check_listed(rel: str, where: str) -> str:
  """A key listed under a source, relative to it: each of its parts plain
  (a bucket may hold an object named ``a/../b``, which a read would
  resolve elsewhere)."""
  for part in rel.split("/"):
    check_key(part, where, f"listed key {rel!r} has a part")
  return rel


def json_depth(value: Any, where: str, limit: int = MAX_JSON_DEPTH) -> None:
  """Refuses a JSON value nested deeper than ``limit`` (one loop, no
  recursion)."""
  level, depth = [value], 0
  while level:
    if depth > limit:
      raise OrbaxImportError(f"{where}: JSON nested deeper than {limit} "
                             "levels; refusing it")
    below = []
    for v in level:
      if isinstance(v, dict):
        below.extend(v.values())
      elif isinstance(v, list):
        below.extend(v)
    level, depth = below, depth + 1


def check_array(shape: tuple[int, ...], chunks: tuple[int, ...],
                dtype: np.dtype, where: str) -> int:
  """An opened source array within ckpt's limits; returns its bytes."""
  name = str(dtype)
  if name not in checks.ALLOWED_DTYPES:
    raise OrbaxImportError(f"{where}: dtype {name} is not one ckpt stores "
                           f"(expected one of {sorted(checks.ALLOWED_DTYPES)})")
  if len(shape) > checks.MAX_RANK:
    raise OrbaxImportError(f"{where}: rank {len(shape)} is over the "
                           f"{checks.MAX_RANK} ckpt stores")
  nbytes = math.prod(shape) * dtype.itemsize
  if nbytes > checks.MAX_LEAF_BYTES:
    raise OrbaxImportError(
        f"{where}: shape {list(shape)} {name} claims {nbytes} bytes; "
        f"expected at most {checks.MAX_LEAF_BYTES} (ckpt's limit on a leaf)")
  count = math.prod(-(-s // c) for s, c in zip(shape, chunks))
  if count > checks.MAX_CHUNKS:
    raise OrbaxImportError(
        f"{where}: {count} chunks of {list(chunks)} in shape {list(shape)}; "
        f"expected at most {checks.MAX_CHUNKS}")
  chunk_bytes = math.prod(chunks) * dtype.itemsize
  memory = hostmem.host_memory_bytes()
  if chunk_bytes > memory:
    raise OrbaxImportError(
        f"{where}: one chunk of {list(chunks)} {name} is {chunk_bytes} bytes, "
        f"more than this host's {memory} bytes of memory (a read decodes a "
        "whole chunk)")
  return nbytes


def check_mesh(sizes: Any, names: Any) -> None:
  """Raises ValueError unless ``sizes`` and ``names`` describe a mesh a
  ckpt index could hold: distinct axis names, positive sizes, at most
  saved_sharding.MAX_MESH_DEVICES devices in all."""
  if (not isinstance(sizes, list) or not isinstance(names, list) or
      len(sizes) != len(names) or len(names) > saved_sharding.MAX_MESH_AXES
      or not all(type(n) is int and 0 < n <= saved_sharding.MAX_MESH_DEVICES
                 for n in sizes) or
      math.prod(sizes) > saved_sharding.MAX_MESH_DEVICES or
      not all(isinstance(a, str) and
              0 < len(a) <= saved_sharding.MAX_AXIS_NAME_LEN for a in names)
      or len(set(names)) != len(names)):
    raise ValueError(
        f"mesh of sizes {str(sizes)[:100]} and axes {str(names)[:100]} "
        f"(expected at most {saved_sharding.MAX_MESH_AXES} distinct axes, "
        f"{saved_sharding.MAX_MESH_DEVICES} devices in all)")


def check_claims(storage, claims: list[tuple[int, str]], url: str,
                 allow_sparse: bool) -> None:
  """Refuses arrays claiming more than SPARSE_FACTOR times the bytes
  stored under the source plus SPARSE_ALLOWANCE. ``claims``: (bytes, the
  array and its metadata file) of every array."""
  claimed = sum(n for n, _ in claims)
  if allow_sparse or claimed <= SPARSE_ALLOWANCE:
    return
  need = -(-(claimed - SPARSE_ALLOWANCE) // SPARSE_FACTOR)
  stored, exact = stored_bytes(storage, need)
  if stored >= need:
    return
  largest = sorted(claims, reverse=True)[:3]
  raise OrbaxImportError(
      f"{url}: its arrays claim {claimed} bytes, but it stores "
      f"{'' if exact else 'less than '}{stored + (not exact)} bytes; an "
      f"import writes at most {SPARSE_FACTOR}x the bytes stored plus "
      f"{SPARSE_ALLOWANCE} (missing chunks read as fill values, compressed "
      "ones expand: a truncated or hostile checkpoint). Largest: "
      + "; ".join(f"{what}: {n} bytes" for n, what in largest) +
      ". If it is what you expect (arrays of zeros, not stored), pass "
      "--allow-sparse (allow_sparse=True)")


def stored_bytes(storage, need: int) -> tuple[int, bool]:
  """(bytes stored under the source, exact): on a disk the sum of its
  regular files' sizes (symbolic links not followed); on a bucket a lower
  bound, raised by one-byte ranged reads until it reaches ``need``."""
  if storage.is_posix:
    total = 0
    for dirpath, _, files in os.walk(os.fspath(storage.root)):
      for f in files:
        try:
          st = os.lstat(os.path.join(dirpath, f))
        except OSError:
          continue
        if stat.S_ISREG(st.st_mode):
          total += st.st_size
    return total, True
  keys = storage.list_all()
  return lower_bound(storage, keys, need), False


def lower_bound(storage, keys: list[str], need: int) -> int:
  """A lower bound on the bytes of ``keys``, at least ``need`` if they
  hold that much (and a few rounds of reads find it). Each round asks every
  object still in play whether it holds the bytes each would need for the
  objects together to reach ``need``; those that do stay in play at that
  size, the others count at the size they last held."""
  done, active, size = 0, list(keys), 0  # done: the objects out of play
  for _ in range(_PROBE_ROUNDS):
    if not active or done + size * len(active) >= need:
      break
    ask = max(size + 1, -(-(need - done) // len(active)))
    holds = storage.sizes_at_least(active, ask)
    kept = [k for k, ok in zip(active, holds) if ok]
    done += size * (len(active) - len(kept))
    active, size = kept, ask
  return done + size * len(active)
