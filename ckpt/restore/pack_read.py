"""Reading packed leaves (ckpt/save/pack.py): the step's pack tables and the
packs' bytes (``PackSet``); the lazy leaf of a packed entry, ``LazyPacked``,
is in ckpt/restore/pack_leaf.py.

Everything read is untrusted: a table is decoded with the index's bounded
msgpack reader, each piece is checked against its leaf (rank, a non-empty
box inside the shape) and its pack (inside the size the table declares,
which a read past the object's end also catches), a leaf's pieces must tile
it exactly, and every piece's crc32c is checked whenever it is read. Any
failure is a CorruptCheckpointError naming the leaf (or the table).

Reads: a restore first ``prefetch``es the pieces of every packed leaf it
places, reading each pack it needs once (whole, or the ranges it needs when
that is less than half of it); a lazy leaf read later reads its own pieces'
byte ranges.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Iterable, Sequence

import crc32c
import numpy as np
import tensorstore as ts

from ckpt.format import index as index_lib
from ckpt.format import seal
from ckpt.format import pack_index
from ckpt.format import pack_table
from ckpt.format import tree
from ckpt.store import tsfuture
from ckpt.errors import CorruptCheckpointError
from ckpt.restore import listed
from ckpt.restore import pack_exact
from ckpt.shards.plan import Box

# Tables read at once.
_TABLE_READS = 32
# Ranges of one pack closer than this are read as one.
_MERGE_GAP = 1 << 20
# ``covers`` of at most this many (piece, box) pairs runs in Python: numpy's
# fixed cost per call is several times that of a few tuple comparisons.
_FEW = 64


@dataclasses.dataclass(frozen=True)
class Piece:
  process: int
  pack: int
  offset: int
  box: Box
  nbytes: int
  crc: int
  row: int  # in the tables (PackSet's)


class PackSet:
  """The packs of one step, read as needed (tables once, on first use)."""

  def __init__(self, index: index_lib.Index, step_kvstore: dict, context,
               where: str = "checkpoint"):
    self.index = index
    self._spec, self._context = step_kvstore, context
    self._where = where
    self._lock = threading.Lock()
    self._table: pack_table.Table | None = None
    self._bounds: tuple[np.ndarray, np.ndarray] | None = None
    self._checked: set[int] = set()
    self._covers: dict[tuple[int, Box], list[Piece]] = {}
    self._made: dict[int, Piece] = {}  # table row -> its Piece
    # The table's columns as Python lists (``_pieces_of`` reads one row at
    # a time: a numpy scalar per field costs more than the Piece), and
    # each distinct box made once (10,000 leaves share a few boxes).
    self._columns: tuple | None = None
    self._boxes: dict[tuple, Box] = {}
    self._cache: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
    # Leaf -> (the boxes a restore places, the row of each box's piece):
    # the leaves whose pieces are exactly those boxes (``prefetch``).
    self._exact: dict[int, tuple[Sequence[Box], list[int]]] = {}
    self._store: ts.KvStore | None = None

  def _kv(self) -> ts.KvStore:
    kv = self._store
    if kv is None:
      kv = self._store = ts.KvStore.open(
          self._spec, context=self._context).result()
    return kv

  # ---- the tables -------------------------------------------------------

  def _tables(self) -> pack_table.Table:
    with self._lock:
      if self._table is None:
        self._table, self._bounds = self._load()
      return self._table

  def _load(self):
    """Every process's table, validated, as one table sorted by leaf, and
    each leaf's [lo, hi) rows in it."""
    kv = self._kv()
    n = self.index.process_count
    leaves = pack_table.Leaves.of(self.index.leaves)
    # A process with no packed box writes no table: the tables there are,
    # from one listing (never one read per process the index claims).
    lo, hi = f"{pack_index.PACK_DIR}/", f"{pack_index.PACK_DIR}0"
    try:
      keys = kv.list(ts.KvStore.KeyRange(lo, hi)).result()
    except Exception as e:
      raise CorruptCheckpointError(
          f"{self._where}: listing the pack tables failed: {e}") from e
    procs = listed.process_numbers(
        (k.decode(errors="replace")[len(lo):] for k in keys), ".msgpack", n)
    names = {p: pack_index.table_name(p) for p in procs}
    tables = []
    for i in range(0, len(procs), _TABLE_READS):
      batch = procs[i:i + _TABLE_READS]
      futures = [kv.read(names[p]) for p in batch]
      for p, f in zip(batch, futures):
        try:
          got = f.result()
        except Exception as e:
          raise CorruptCheckpointError(
              f"{self._where}: reading the pack table {names[p]!r} failed: "
              f"{e}") from e
        if got.state != "value":
          continue  # deleted since the listing: as if it had no packed box
        tables.append(self._decode(p, names[p], got.value, leaves))
    table = pack_table.concat(tables, leaves.shape.shape[1])
    every = np.arange(len(self.index.leaves))
    return table, (np.searchsorted(table.leaf, every, "left"),
                   np.searchsorted(table.leaf, every, "right"))

  def _decode(self, p: int, name: str, data: bytes,
              leaves: pack_table.Leaves) -> pack_table.Table:
    where = f"{self._where}: pack table {name!r}"
    if len(data) > pack_index.MAX_TABLE_BYTES:
      raise CorruptCheckpointError(
          f"{where}: {len(data)} bytes, over the limit "
          f"{pack_index.MAX_TABLE_BYTES}")
    data = seal.maybe_unseal(data, where, self.index.sealed)
    try:
      doc = index_lib.unpack(data)
    except Exception as e:
      raise CorruptCheckpointError(f"{where} is not valid msgpack: {e}") from e
    return pack_table.decode(doc, p, leaves, where)

  def _rows(self, leaf: int) -> np.ndarray:
    """The rows of the ``leaf``-th entry's pieces in the tables."""
    table = self._tables()
    lo, hi = self._bounds
    return np.arange(lo[leaf], hi[leaf]) if len(table) else np.arange(0)

  def _pieces_of(self, rows: np.ndarray, rank: int) -> list[Piece]:
    """The Pieces of these rows (each made once)."""
    made = self._made
    out = []
    for r in rows.tolist():
      pc = made.get(r)
      if pc is None:
        pc = made[r] = self._piece_of(r, rank)
      out.append(pc)
    return out

  def _cols(self) -> tuple:
    cols = self._columns
    if cols is None:
      t = self._table
      cols = self._columns = (
          t.process.tolist(), t.pack.tolist(), t.offset.tolist(),
          t.nbytes.tolist(), t.crc.tolist(), t.start.tolist(),
          t.stop.tolist())
    return cols

  def _piece_of(self, r: int, rank: int) -> Piece:
    process, pack, offset, nbytes, crc, start, stop = self._cols()
    corners = (tuple(start[r][:rank]), tuple(stop[r][:rank]))
    box = self._boxes.get(corners)
    if box is None:
      box = self._boxes[corners] = Box(*corners)
    return Piece(process[r], pack[r], offset[r], box, nbytes[r], crc[r],
                 r)

  async def pieces_async(self, leaf: int) -> list[Piece]:
    if self._table is None:  # read the tables off the event loop, once
      await asyncio.to_thread(self._tables)
    return self.pieces(leaf)

  async def cover_async(self, leaf: int, box: Box) -> list[Piece]:
    if self._table is None:
      await asyncio.to_thread(self._tables)
    return self.cover(leaf, box)

  def pieces(self, leaf: int) -> list[Piece]:
    """All pieces of the ``leaf``-th entry, checked to tile it exactly
    (verify; a restore checks only the boxes it reads: ``cover``)."""
    e = self.index.leaves[leaf]
    got = self._pieces_of(self._rows(leaf), len(e.shape))
    if leaf not in self._checked:
      self._check_cover(leaf, Box((0,) * len(e.shape), tuple(e.shape)), got)
      self._checked.add(leaf)
    return got

  def cover(self, leaf: int, box: Box) -> list[Piece]:
    """The pieces of the ``leaf``-th entry that overlap ``box``, checked to
    cover it exactly once (every element of it from one piece)."""
    got = self._covers.get((leaf, box))
    if got is None:
      got = self.covers(leaf, [box])[0]
    return got

  def covers(self, leaf: int, boxes: Sequence[Box]) -> list[list[Piece]]:
    """``cover`` of each of ``boxes`` (one numpy pass over the leaf's
    pieces for them all)."""
    rows = self._rows(leaf)
    rank = len(self.index.leaves[leaf].shape)
    if len(rows) * len(boxes) <= _FEW:  # a small leaf: no numpy
      return self._few_covers(leaf, rows, rank, boxes)
    t = self._table
    shape = (len(boxes), rank)
    lo = np.asarray([b.start for b in boxes], np.int64).reshape(shape)
    hi = np.asarray([b.stop for b in boxes], np.int64).reshape(shape)
    a, b = t.start[rows, :rank], t.stop[rows, :rank]
    near = ((a[None] < hi[:, None]) & (b[None] > lo[:, None])).all(axis=2)
    exact = ((a[None] == lo[:, None]) & (b[None] == hi[:, None])).all(axis=2)
    out = []
    for j, box in enumerate(boxes):
      got = self._covers.get((leaf, box))
      if got is None:
        got = self._pieces_of(rows[near[j]], rank)
        # one piece that is the box covers it exactly; else count
        if box.size and not (len(got) == 1 and exact[j].any()):
          self._check_cover(leaf, box, got)
        self._covers[(leaf, box)] = got
      out.append(got)
    return out

  def _few_covers(self, leaf: int, rows: np.ndarray, rank: int,
                  boxes: Sequence[Box]) -> list[list[Piece]]:
    """``covers`` of a leaf with few pieces and boxes, in Python (the same
    overlap test and the same checks as the numpy pass)."""
    pieces = self._pieces_of(rows, rank)
    out = []
    for box in boxes:
      got = self._covers.get((leaf, box))
      if got is None:
        got = [pc for pc in pieces if _overlap(pc.box, box)]
        if box.size and not (len(got) == 1 and got[0].box == box):
          self._check_cover(leaf, box, got)
        self._covers[(leaf, box)] = got
      out.append(got)
    return out

  def _check_cover(self, leaf: int, box: Box, got: list[Piece]) -> None:
    def part(pc: Piece) -> Box:
      return Box(tuple(map(max, pc.box.start, box.start)),
                 tuple(map(min, pc.box.stop, box.stop)))

    covered = sum(part(pc).size for pc in got)
    exact = covered == box.size
    if exact and len(got) > 1:  # no overlap: every element once
      mask = np.zeros(box.shape, np.uint8)
      for pc in got:
        mask[part(pc).relative_to(box)] += 1
      exact = bool((mask == 1).all())
    if not exact:
      e = self.index.leaves[leaf]
      whole = box.start == (0,) * len(box.start) and box.stop == tuple(e.shape)
      what = "it" if whole else f"its box {box.start}..{box.stop}"
      raise CorruptCheckpointError(
          f"{self._where}: leaf {tree.path_str(e.path)!r}: the pack tables' "
          f"pieces ({len(got)} boxes, {covered} of the {box.size} elements "
          f"of {what}) do not cover it exactly once (a process's table or "
          "pack missing, or edited)")

  # ---- the bytes ----------------------------------------------------------

  async def prefetch(self, leaves: Iterable[int],
                     boxes: dict[int, Sequence[Box]] | None = None) -> None:
    """Reads the packs holding ``leaves``' pieces (only those overlapping
    ``boxes[leaf]`` where given: the boxes this process places), each pack
    once: whole, or the ranges needed (merged) when those are under half
    of it."""
    await asyncio.to_thread(self._tables)
    boxes = boxes or {}
    rows = self._exact_rows(leaves, boxes)  # (theirs: no Piece, no cover)
    pieces = []
    for leaf in leaves:
      if leaf in self._exact:
        continue
      wanted = boxes.get(leaf)
      if wanted is None:
        pieces += self._pieces_of(self._rows(leaf),
                                  len(self.index.leaves[leaf].shape))
      else:
        pieces += {id(pc): pc for cover in self.covers(leaf, wanted)
                   for pc in cover}.values()  # (each Piece made once)
    t = self._table
    rows = np.concatenate([rows, np.asarray(
        [pc.row for pc in pieces], np.int64)]) if pieces else rows
    sizes = pack_exact.merged_ranges(
        t.process[rows], t.pack[rows], t.offset[rows],
        t.offset[rows] + t.nbytes[rows], _MERGE_GAP)
    kv = (self._store if self._store is not None
          else await asyncio.to_thread(self._kv))
    reads = []
    for (p, k), merged in sizes.items():
      if (p, k) in self._cache:
        continue
      needed = sum(b - a for a, b in merged)
      if needed * 2 >= merged[-1][1] - merged[0][0] or len(merged) == 1:
        merged = [[merged[0][0], merged[-1][1]]]
      reads.append(((p, k), [(a, self._range(kv, p, k, a, b))
                             for a, b in merged]))
    for key, parts in reads:
      got = []
      for a, f in parts:
        got.append((a, await self._value(f, key)))
      self._cache[key] = got

  def _exact_rows(self, leaves: Iterable[int],
                  boxes: dict[int, Sequence[Box]]) -> np.ndarray:
    """The leaves whose pieces are exactly the boxes placed (one group
    per boxes object: ``boxes_placed`` shares a placement's), noted in
    ``_exact``; the rows of their pieces."""
    groups: dict[int, list[int]] = {}
    for leaf in leaves:
      wanted = boxes.get(leaf)
      if type(wanted) is tuple:  # pylint: disable=unidiomatic-typecheck
        groups.setdefault(id(wanted), []).append(leaf)
    out = [np.zeros(0, np.int64)]
    for members in groups.values():
      wanted = boxes[members[0]]
      rank = len(self.index.leaves[members[0]].shape)
      same = np.asarray(members, np.int64)
      ranks = np.asarray([len(self.index.leaves[m].shape) for m in members])
      found, rows = pack_exact.exact_rows(
          self._table, self._bounds, same[ranks == rank], wanted, rank)
      for leaf, of_leaf in zip(found.tolist(), rows.tolist()):
        self._exact[leaf] = (wanted, of_leaf)
      out.append(rows.reshape(-1))
    return np.concatenate(out)

  def exact(self, leaf: int, boxes: Sequence[Box]) -> list[int] | None:
    """The row of each of ``boxes``' pieces where ``prefetch`` found the
    ``leaf``-th entry's pieces to be exactly these boxes, else None."""
    got = self._exact.get(leaf)
    return got[1] if got is not None and got[0] is boxes else None

  def row_bytes(self, r: int, path: str) -> memoryview | None:
    """``cached_bytes`` of the piece at row ``r`` of the tables, with no
    Piece made unless the check fails (its error names ``path``)."""
    process, pack, offset, nbytes, crc, _, _ = self._cols()
    p, k, at, n = process[r], pack[r], offset[r], nbytes[r]
    for a, blob in self._cache.get((p, k), ()):
      if a <= at and at + n <= a + len(blob):
        data = memoryview(blob)[at - a:at - a + n]
        if len(data) != n or crc32c.crc32c(data) != crc[r]:
          rank = len(self.index.leaves[self._table.leaf[r]].shape)
          return self._verified(self._piece_of(r, rank), path, data)
        return data
    return None

  def drop_cache(self) -> None:
    self._cache.clear()
    self._exact.clear()

  def _range(self, kv, p: int, k: int, a: int, b: int):
    return kv.read(pack_index.pack_name(p, k), byte_range=slice(a, b))

  async def _value(self, future, key: tuple[int, int], leaf: str = "") -> bytes:
    name = pack_index.pack_name(*key)
    try:
      got = await tsfuture.wait(future)
    except Exception as e:
      raise CorruptCheckpointError(
          f"{self._where}: reading pack {name!r}{leaf} failed (truncated "
          f"or missing?): {e}") from e
    if got.state != "value":
      raise CorruptCheckpointError(
          f"{self._where}: pack {name!r}{leaf} is missing")
    return got.value

  def cached_bytes(self, pc: Piece, path: str) -> memoryview | None:
    """The bytes of ``pc`` from the prefetched packs, checked against its
    crc32c; None if they were not prefetched."""
    for a, blob in self._cache.get((pc.process, pc.pack), ()):
      if a <= pc.offset and pc.offset + pc.nbytes <= a + len(blob):
        return self._verified(
            pc, path, memoryview(blob)[pc.offset - a:pc.offset - a + pc.nbytes])
    return None

  async def piece_bytes(self, pc: Piece, path: str) -> memoryview:
    """The bytes of ``pc``, checked against its crc32c."""
    data = self.cached_bytes(pc, path)
    if data is not None:
      return data
    kv = (self._store if self._store is not None
          else await asyncio.to_thread(self._kv))
    data = memoryview(await self._value(
        self._range(kv, pc.process, pc.pack, pc.offset,
                    pc.offset + pc.nbytes), (pc.process, pc.pack),
        f" for leaf {path!r}"))
    return self._verified(pc, path, data)

  def _verified(self, pc: Piece, path: str, data: memoryview) -> memoryview:
    if len(data) != pc.nbytes:
      raise CorruptCheckpointError(
          f"leaf {path!r}: pack {pack_index.pack_name(pc.process, pc.pack)!r}"
          f" holds {len(data)} of the {pc.nbytes} bytes of box "
          f"{pc.box.start}..{pc.box.stop} (truncated)")
    if crc32c.crc32c(data) != pc.crc:
      raise CorruptCheckpointError(
          f"leaf {path!r}: box {pc.box.start}..{pc.box.stop} in pack "
          f"{pack_index.pack_name(pc.process, pc.pack)!r} does not match its "
          "crc32c checksum (corrupt data)")
    return data


def _overlap(a: Box, b: Box) -> bool:
  """Whether boxes ``a`` and ``b`` share an element (as ``covers``)."""
  for a0, a1, b0, b1 in zip(a.start, a.stop, b.start, b.stop):
    if a0 >= b1 or a1 <= b0:
      return False
  return True


def has_packed(index: index_lib.Index) -> bool:
  """Whether the step has packed (small) leaves."""
  return any(isinstance(e, pack_index.PackedEntry) for e in index.leaves)
