"""A process's pack table: where its boxes of packed leaves are.

``<step dir>/.packs/<process>.msgpack`` (ckpt/format/pack_index.py). Every
restoring process reads every process's table (it cannot know who wrote
the boxes it needs before it has read them), so a job of P processes reads
P tables of about as many rows as there are packed leaves: a table must be
cheap to read. Since index version 3 (table version 2) a table is columns
of little-endian integers, validated column-wide in numpy:

  {"process": p, "version": 2, "packs": [size of pack 0, ...],
   "leaf": <u4 per piece>, "pack": <u4>, "offset": <u8>, "crc": <u4>,
   "box": <u8: each piece's start then its stop, as many of each as its
           leaf's rank in the index>}

Index version 2 wrote rows, which are still read (converted to columns):

  {"process": p, "packs": [...],
   "pieces": [[leaf, pack, offset, [start...], [stop...], crc32c], ...]}

Whatever is read is untrusted: each piece must belong to a packed leaf of
the index, be a non-empty box inside its shape, and lie inside its pack.
The first piece at fault is named by its leaf (CorruptCheckpointError).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import msgpack
import numpy as np

from ckpt.format import checks
from ckpt.format import pack_index
from ckpt.format import tree

VERSION = 2
_COLUMNS = {"leaf": "<u4", "pack": "<u4", "offset": "<u8", "crc": "<u4"}


@dataclasses.dataclass(frozen=True)
class Leaves:
  """What a table's pieces are checked against: the index's leaves."""
  entries: tuple
  rank: np.ndarray      # per leaf: its rank, -1 if it is not packed
  shape: np.ndarray     # (leaves, R): its shape, 1 past its rank
  itemsize: np.ndarray  # per leaf: its dtype's bytes (0 if not packed)

  @classmethod
  def of(cls, entries: Sequence[Any]) -> "Leaves":
    packed = [isinstance(e, pack_index.PackedEntry) for e in entries]
    width = max([len(e.shape) for e, p in zip(entries, packed) if p],
                default=0)
    rank = np.full(len(entries), -1, np.int64)
    shape = np.ones((len(entries), width), np.int64)
    itemsize = np.zeros(len(entries), np.int64)
    for i, (e, p) in enumerate(zip(entries, packed)):
      if p:
        rank[i] = len(e.shape)
        shape[i, :len(e.shape)] = e.shape
        itemsize[i] = np.dtype(e.dtype).itemsize
    return cls(tuple(entries), rank, shape, itemsize)

  def path(self, leaf: int) -> str:
    return tree.path_str(self.entries[leaf].path)


@dataclasses.dataclass(frozen=True)
class Table:
  """Pieces as columns (one row per piece); ``start``/``stop`` are (n, R),
  padded with [0, 1) past a leaf's rank."""
  process: np.ndarray
  leaf: np.ndarray
  pack: np.ndarray
  offset: np.ndarray
  nbytes: np.ndarray
  crc: np.ndarray
  start: np.ndarray
  stop: np.ndarray

  def __len__(self) -> int:
    return len(self.leaf)

  def take(self, rows) -> "Table":
    return Table(*(getattr(self, f.name)[rows]
                   for f in dataclasses.fields(self)))


def concat(tables: Sequence[Table], width: int) -> Table:
  """One table of all ``tables``' pieces, sorted by leaf (stable)."""
  if not tables:
    empty = np.zeros(0, np.int64)
    return Table(empty, empty, empty, empty, empty, empty,
                 np.zeros((0, width), np.int64), np.zeros((0, width), np.int64))
  whole = Table(*(np.concatenate([getattr(t, f.name) for t in tables])
                  for f in dataclasses.fields(Table)))
  return whole.take(np.argsort(whole.leaf, kind="stable"))


def encode(process: int, sizes: list[int], leaf: Sequence[int],
           pack: Sequence[int], offset: Sequence[int], crc: Sequence[int],
           boxes: Sequence[int]) -> bytes:
  """A table (version 2); ``boxes``: each piece's start then stop, flat."""
  doc = {"process": process, "version": VERSION, "packs": list(sizes)}
  for name, values in (("leaf", leaf), ("pack", pack), ("offset", offset),
                       ("crc", crc)):
    doc[name] = np.asarray(values, _COLUMNS[name]).tobytes()
  doc["box"] = np.asarray(boxes, "<u8").tobytes()
  return msgpack.packb(doc, use_bin_type=True)


def decode(doc: Any, process: int, leaves: Leaves, where: str) -> Table:
  """The pieces of a table read from a checkpoint (an unpacked msgpack
  document), validated; CorruptCheckpointError naming ``where`` or the
  first piece's leaf at fault."""
  bad = checks.bad
  if not isinstance(doc, dict) or doc.get("process") != process:
    raise bad(where, f"a map with process {process}", doc)
  sizes = doc.get("packs")
  if (not isinstance(sizes, list) or len(sizes) > pack_index.MAX_PACKS or
      not all(type(s) is int and 0 <= s <= pack_index.MAX_PACK_BYTES
              for s in sizes)):
    raise bad(where, f"packs as a list of at most {pack_index.MAX_PACKS} "
              f"sizes in [0, {pack_index.MAX_PACK_BYTES}]", sizes)
  version = doc.get("version", 1)
  if version == 1:
    cols = _from_rows(doc.get("pieces"), leaves, where)
  elif version == VERSION:
    cols = _columns(doc, leaves, where)
  else:
    raise bad(where, f"table version 1 or {VERSION}", version)
  return _checked(process, np.asarray(sizes, np.int64), *cols, leaves, where)


def _columns(doc: dict, leaves: Leaves, where: str):
  bad = checks.bad
  cols = []
  for name, dtype in _COLUMNS.items():
    raw = doc.get(name)
    size = np.dtype(dtype).itemsize
    if not isinstance(raw, bytes) or len(raw) % size:
      raise bad(where, f"column {name} as bytes of {dtype} integers",
                f"{len(raw)} bytes" if isinstance(raw, bytes) else raw)
    cols.append(np.frombuffer(raw, dtype).astype(np.int64))
  n = len(cols[0])
  if any(len(c) != n for c in cols):
    raise bad(where, f"columns of {n} pieces each",
              {k: len(c) for k, c in zip(_COLUMNS, cols)})
  leaf = cols[0]
  _check_leaves(leaf, leaves, where)
  ranks = leaves.rank[leaf]
  raw = doc.get("box")
  want = 2 * int(ranks.sum())
  if not isinstance(raw, bytes) or len(raw) != 8 * want:
    raise bad(where, f"column box as {want} <u8 integers (a start and a stop "
              "per dimension of each piece's leaf)",
              f"{len(raw)} bytes" if isinstance(raw, bytes) else raw)
  flat = np.frombuffer(raw, "<u8")
  if flat.size and flat.max() >= 2**62:
    raise bad(where, "box bounds under 2**62", int(flat.max()))
  flat = flat.astype(np.int64)
  width = leaves.shape.shape[1]
  start = np.zeros((n, width), np.int64)
  stop = np.ones((n, width), np.int64)
  if n:
    row = np.repeat(np.arange(n), ranks)
    first = np.repeat(np.cumsum(2 * ranks) - 2 * ranks, ranks)
    dim = np.arange(len(row)) - np.repeat(np.cumsum(ranks) - ranks, ranks)
    start[row, dim] = flat[first + dim]
    stop[row, dim] = flat[first + dim + np.repeat(ranks, ranks)]
  return leaf, cols[1], cols[2], cols[3], start, stop


def _from_rows(pieces: Any, leaves: Leaves, where: str):
  """Version 1's rows as columns (each row's types checked here, the
  values with the columns')."""
  bad = checks.bad
  if not isinstance(pieces, list):
    raise bad(where, "pieces as a list", pieces)
  n, width = len(pieces), leaves.shape.shape[1]
  leaf, pack, offset, crc = (np.zeros(n, np.int64) for _ in range(4))
  start = np.zeros((n, width), np.int64)
  stop = np.ones((n, width), np.int64)
  for i, item in enumerate(pieces):
    if not isinstance(item, list) or len(item) != 6:
      raise bad(where, "a piece [leaf, pack, offset, start, stop, crc32c]",
                item)
    lf, k, off, a, b, c = item
    if (type(lf) is not int or not 0 <= lf < len(leaves.rank) or
        leaves.rank[lf] < 0):
      raise bad(where, "a piece of a packed leaf of the index", item)
    lw = f"{where}: leaf {leaves.path(lf)!r}"
    if type(k) is not int or not 0 <= k < 2**32:
      raise bad(lw, "a pack number", k)
    if type(c) is not int or not 0 <= c < 2**32:
      raise bad(lw, "a crc32c", c)
    if type(off) is not int or not -2**62 < off < 2**62:
      raise bad(lw, "an offset", off)
    r = int(leaves.rank[lf])
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == r ==
            len(b) and all(type(x) is int and -2**62 < x < 2**62
                           for x in a + b)):
      raise bad(lw, f"a non-empty box inside the shape "
                f"{list(leaves.entries[lf].shape)}", [a, b])
    leaf[i], pack[i], offset[i], crc[i] = lf, k, off, c
    start[i, :r], stop[i, :r] = a, b
  return leaf, pack, offset, crc, start, stop


def _check_leaves(leaf: np.ndarray, leaves: Leaves, where: str) -> None:
  ok = (leaf < len(leaves.rank))
  ok[ok] = leaves.rank[leaf[ok]] >= 0
  if not ok.all():
    i = int(np.argmin(ok))
    raise checks.bad(where, "pieces of packed leaves of the index",
                      f"piece {i} of leaf number {int(leaf[i])}")


def _checked(process: int, sizes: np.ndarray, leaf, pack, offset, crc,
             start, stop, leaves: Leaves, where: str) -> Table:
  """The columns as a Table, once every piece is inside its leaf and its
  pack (vectorized; the first piece at fault is named)."""
  bad = checks.bad
  shape = leaves.shape[leaf]
  in_shape = ((start >= 0) & (start < stop) & (stop <= shape)).all(axis=1)
  nbytes = np.prod(np.where(in_shape[:, None], stop - start, 0), axis=1,
                   dtype=np.int64) * leaves.itemsize[leaf]
  in_packs = pack < len(sizes)
  end = np.where(in_packs, sizes[np.minimum(pack, max(len(sizes) - 1, 0))]
                 if len(sizes) else 0, -1)
  in_pack = in_packs & (offset >= 0) & (offset <= end - nbytes)
  ok = in_shape & in_pack
  if not ok.all():
    i = int(np.argmin(ok))
    lf = int(leaf[i])
    lw = f"{where}: leaf {leaves.path(lf)!r}"
    r = int(leaves.rank[lf])
    if not in_shape[i]:
      raise bad(lw, f"a non-empty box inside the shape "
                f"{list(leaves.entries[lf].shape)}",
                [start[i, :r].tolist(), stop[i, :r].tolist()])
    if not in_packs[i]:
      raise bad(lw, f"a pack number in [0, {len(sizes)})", int(pack[i]))
    raise bad(lw, f"an offset of its {int(nbytes[i])} bytes inside pack "
              f"{int(pack[i])} of {int(sizes[pack[i]])} bytes", int(offset[i]))
  return Table(np.full(len(leaf), process, np.int64), leaf, pack, offset,
               nbytes, crc, start, stop)


# ---- the same table as rows (tools and tests) -------------------------------

def rows(doc: dict, entries: Sequence[Any]) -> list[list]:
  """A well-formed version 2 table's pieces as version 1's rows
  ([leaf, pack, offset, start, stop, crc32c]). Unvalidated."""
  if doc.get("version", 1) == 1:
    return doc["pieces"]
  cols = {k: np.frombuffer(doc[k], t).tolist() for k, t in _COLUMNS.items()}
  flat = np.frombuffer(doc["box"], "<u8").tolist()
  out, at = [], 0
  for lf, k, off, c in zip(cols["leaf"], cols["pack"], cols["offset"],
                           cols["crc"]):
    r = len(entries[lf].shape)
    out.append([lf, k, off, flat[at:at + r], flat[at + r:at + 2 * r], c])
    at += 2 * r
  return out


def with_rows(doc: dict, pieces: list[list]) -> dict:
  """``doc`` (either version) with these rows, as version 2 columns.
  Unvalidated: values that do not fit a column raise OverflowError."""
  out = {k: v for k, v in doc.items() if k not in ("pieces", "box", *_COLUMNS)}
  out["version"] = VERSION
  for j, name in enumerate(("leaf", "pack", "offset")):
    out[name] = np.asarray([p[j] for p in pieces], _COLUMNS[name]).tobytes()
  out["crc"] = np.asarray([p[5] for p in pieces], _COLUMNS["crc"]).tobytes()
  out["box"] = np.asarray([x for p in pieces for x in p[3] + p[4]],
                          "<u8").tobytes()
  return out
