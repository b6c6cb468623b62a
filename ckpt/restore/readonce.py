"""Read once, spread the reading: restore onto a mesh with replicas.

With a target NamedSharding, the mesh axes its spec does not use are replica
axes: the processes along them hold the same boxes. Read naively, each of
them reads every box it holds from storage, so a restore with R replica
processes pulls R times the checkpoint. Here each leaf is instead split
over its replicas (ckpt/restore/readsplit.py): each process reads a distinct part,
in whole stored chunks, so that every chunk is fetched from the store once
over all processes; the parts are then exchanged with one ``jax.jit``
program whose ``out_shardings`` are the target shardings (XLA inserts the
all-gather or all-reduce over the replica devices, gloo across processes on
CPU). The result is bit-exact and has exactly the target's sharding.

Every process must issue the same collectives in the same order, so every
decision here is computed from information all processes share: the target
shardings (global meshes), leaf shapes and dtypes (from the one index), the
policy option (checked equal by the restore's agreement round) and the
storage kind. The exchange runs on the caller's thread (never the
Checkpointer's background thread), in batches whose host bytes (the parts
read plus the gathered boxes) stay within half of ``concurrent_bytes``; a
batch is read (background thread, under the byte limiter) while the one
before it is exchanged, so the two together stay within
``concurrent_bytes`` (``finish``).

Not read once (the normal read, each process its own boxes): leaves with no
NamedSharding target, no replica axis across processes, typed PRNG keys,
values already in memory (inline leaves, fallback values), and leaves
derived by a transform with no dimension that divides by the replica
count.

Lazy leaves (``restore(lazy=True)``) read once too, when they are read
later: a leaf the restore would have read once carries a ``LazyPlan``, and
its ``read()`` / ``read_async()`` with the sharding it was bound to reads
this process's part of its split, runs the failure round and
exchanges that one leaf (``LazyPlan.finish``). That read is a collective
call: every process reads the same leaves in the same order. The rounds of
one Checkpointer's lazy reads (``LazyRounds``) are numbered in the order
the reads are called, and their collective part runs in that order even
when reads overlap (``asyncio.gather`` of ``read_async``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import tree_util

from ckpt.multihost import process as multihost
from ckpt.restore import readsplit
# ReadCounter and counted: what the Checkpointer's restore counts with.
from ckpt.restore.readcount import ReadCounter
from ckpt.store import storemeter


# The automatic policy (read_once=None), chosen from scripts/bench.py's
# multi-process restore figures (see docs/benchmarks.md "Read once"): on an object
# store every byte read is a request to a remote server, and exchanging over
# the job's interconnect is cheaper, from 2 replicas on. On a local disk
# (file://, a path) reading is served by the page cache at memory speed, and
# the exchange costs more than the reads it saves: off.
AUTO_MIN_REPLICAS = {"object": 2, "disk": None, "memory": None}
OBJECT_SCHEMES = ("s3", "gs", "gcs", "http", "https")


def storage_kind(url: str) -> str:
  scheme = url.split("://", 1)[0] if "://" in url else "file"
  if scheme in OBJECT_SCHEMES:
    return "object"
  if scheme == "memory":
    return "memory"
  return "disk"


def min_replicas(read_once: bool | None, url: str) -> int | None:
  """The replica count from which a leaf is read once; None: never."""
  if read_once is None:
    return AUTO_MIN_REPLICAS.get(storage_kind(url))
  if read_once is True:
    return 2
  if read_once is False:
    return None
  raise ValueError(f"read_once must be True, False or None, got {read_once!r}")


# ---- what a restore read -----------------------------------------------------

@dataclasses.dataclass
class RestoreStats:
  """What the last ``Checkpointer.restore`` did on this process.

  bytes_read: bytes of the boxes read from stored arrays (stored dtype:
  the logical bytes); chunk_bytes_read: of the whole stored chunks those
  boxes touch; fetched_bytes: bytes this process fetched from the store
  during the restore, as TensorStore's kvstore drivers count them
  (ckpt/store/storemeter.py: what the store served, whole chunks, metadata and
  the index included, compressed as stored; process-wide, so other reads
  of this process at the same time count too); fetched_bytes_all: the sum
  of every process's fetched_bytes, carried by the restore's last
  agreement round (read once in a multi-process job; for lazy leaves as of
  the last one read once), None where no round ran;
  read_once_leaves: leaves read once and exchanged; exchanged_bytes: bytes
  this process's devices received from the exchange (gathered boxes minus
  the parts read here); exchange_s: time in the exchange programs;
  batches: how many exchange programs (batches); overlapped_batches: how
  many of them were read while the one before was exchanged;
  peak_read_bytes: the most
  bytes the restore's byte limiters had granted at once (reads in flight,
  at most ``concurrent_bytes``); peak_batch_bytes: the largest exchange
  batch, measured: bytes of this process's device buffers of the batch's
  parts read plus its gathered arrays (within ``concurrent_bytes`` unless
  one leaf alone is larger); total_s: the whole call.

  Where the time went, in seconds that add up to total_s with ``other_s``:
  find_s (agreeing on the step: the round and, on process 0, the listing),
  index_s (reading and decoding the index), read_s (the reads, checks and
  placing on devices, on the background loop, until they ended; with
  ``restore_async`` the caller's time until ``result()`` beyond that is
  other_s),
  finish_s (on the caller's thread: the outcome round, the read-once
  batches and their exchange), rounds_s (the verification round of a
  resume, and a fallback's choice), other_s (the rest).

  A ``lazy=True`` restore's stats keep growing as its leaves are read (the
  bytes they read, and for leaves read once their exchange); total_s stays
  the restore call's.
  """
  read_once: bool | None = None
  bytes_read: int = 0
  chunk_bytes_read: int = 0
  fetched_bytes: int = 0
  fetched_bytes_all: int | None = None
  reads: int = 0
  read_once_leaves: int = 0
  exchanged_bytes: int = 0
  exchange_s: float = 0.0
  batches: int = 0
  overlapped_batches: int = 0
  peak_read_bytes: int = 0
  peak_batch_bytes: int = 0
  total_s: float = 0.0
  find_s: float = 0.0
  index_s: float = 0.0
  read_s: float = 0.0
  finish_s: float = 0.0
  rounds_s: float = 0.0

  @property
  def other_s(self) -> float:
    """total_s less the stages counted."""
    return max(0.0, self.total_s - self.find_s - self.index_s - self.read_s
               - self.finish_s - self.rounds_s)

  def stages_text(self) -> str:
    """The stages for a log line."""
    return (f"find {self.find_s:.3f} s, index {self.index_s:.3f} s, read "
            f"{self.read_s:.3f} s, finish {self.finish_s:.3f} s, rounds "
            f"{self.rounds_s:.3f} s, other {self.other_s:.3f} s")

  def add_reads(self, counter: ReadCounter) -> None:
    """Takes the counts of ``counter`` (this restore's)."""
    self.bytes_read = counter.bytes_read
    self.chunk_bytes_read = counter.chunk_bytes_read
    self.reads = counter.reads
    self.peak_read_bytes = max(self.peak_read_bytes, counter.peak_in_use)


# ---- leaves read once -------------------------------------------------------

@dataclasses.dataclass
class Deferred:
  """A leaf to read split over its replicas (``split``, ckpt/restore/readsplit.py)
  and exchange into ``sharding`` (a placeholder in the tree restore_tree
  returns)."""
  name: str
  src: Any  # LazyLeaf
  out_dtype: np.dtype
  sharding: Any
  split: Any  # readsplit.EvenSplit | readsplit.ChunkSplit
  cost: int


def deferred(name: str, src, out_dtype, sharding, min_r: int | None,
             order: int = 0) -> Deferred | None:
  """``order``: the leaf's place in the target (the same on every
  process), which spreads leaves of fewer chunks than readers."""
  shape = tuple(src.shape)
  chunks = getattr(getattr(src, "entry", None), "chunks", None)
  split = readsplit.plan(sharding, shape, tuple(chunks) if chunks else None,
                         out_dtype, min_r, order)
  if split is None:
    return None
  return Deferred(name, src, np.dtype(out_dtype), sharding, split,
                  readsplit.per_process_bytes(split, shape,
                                              np.dtype(out_dtype).itemsize))


# ---- the exchange (caller's thread) -----------------------------------------

def exchange(parts: Sequence[readsplit.Part], shardings: Sequence[Any],
             stats: RestoreStats) -> tuple[jax.Array, ...]:
  """One jit program: each part (this process's reads of one leaf) into
  its target sharding; XLA all-gathers (or all-reduces) over the replica
  devices. A collective: on the caller's thread, in the same order on
  every process."""
  t0 = time.perf_counter()
  outs = readsplit.exchange_program(parts, shardings)
  jax.block_until_ready(outs)
  stats.exchange_s += time.perf_counter() - t0
  stats.batches += 1
  held = 0
  for p, o in zip(parts, outs):
    got = sum(s.data.nbytes for s in o.addressable_shards)
    stats.exchanged_bytes += max(0, got - p.mine)
    held += got + sum(s.data.nbytes for s in p.array.addressable_shards)
  stats.peak_batch_bytes = max(stats.peak_batch_bytes, held)
  stats.read_once_leaves += len(outs)
  return outs


def batches(items: list[Deferred], budget: int) -> list[list[Deferred]]:
  """Consecutive items whose costs sum to at most ``budget`` (an item larger
  than the budget alone). Costs are global, so every process cuts the same
  batches: each batch is one collective program."""
  out, cur, used = [], [], 0
  for it in items:
    if cur and used + it.cost > budget:
      out.append(cur)
      cur, used = [], 0
    cur.append(it)
    used += it.cost
  if cur:
    out.append(cur)
  return out


def finish(result: Any,
           read: Callable[[list[Deferred]], list[readsplit.Part]],
           budget: int, stats: RestoreStats,
           check: Callable[[int, BaseException | None], None] = (
               lambda i, e: None)) -> Any:
  """Replaces every Deferred leaf of ``result`` by its exchanged array.

  ``read(batch)`` reads a batch, each leaf this process's part of its
  split (on the background thread, under the byte limiter); ``check(i,
  error)`` is a round in which every process says whether batch i was read
  (``multihost.all_ok``); the exchange runs here, on the caller's thread,
  one jit program per batch.

  Overlap: batches are cut at half the budget, and batch i+1 is read (on a
  reader thread) while batch i is checked and exchanged here, when their
  costs fit the budget together (global costs: every process decides the
  same), so the parts and gathered arrays of the batch being exchanged
  plus the parts being read stay within ``budget``. Only reads overlap:
  the collectives (round i, exchange i, round i+1, ...) keep one order on
  every process, and a read that fails, prefetched or not, goes into its
  own batch's round (never skips a collective on one process).
  """
  leaves, treedef = tree_util.tree_flatten(
      result, is_leaf=lambda x: isinstance(x, Deferred))
  pos = [i for i, x in enumerate(leaves) if isinstance(x, Deferred)]
  if not pos:
    return result
  items = [leaves[i] for i in pos]
  cut = batches(items, max(1, budget // 2))
  costs = [sum(b.cost for b in batch) for batch in cut]
  done: dict[int, jax.Array] = {}
  pool = concurrent.futures.ThreadPoolExecutor(
      1, thread_name_prefix="ckpt-readonce-read")
  pending: concurrent.futures.Future | None = None
  try:
    pending = pool.submit(read, cut[0])
    for i, batch in enumerate(cut):
      parts, error = None, None
      try:
        parts = pending.result()
      except (Exception, asyncio.CancelledError,  # pylint: disable=broad-except
              concurrent.futures.CancelledError) as e:
        error = e  # into this batch's round: every process raises
      pending = None
      last = i + 1 == len(cut)
      if not last and error is None and costs[i] + costs[i + 1] <= budget:
        pending = pool.submit(read, cut[i + 1])  # overlaps round + exchange
        stats.overlapped_batches += 1
      check(i, error)
      outs = exchange(parts, [b.sharding for b in batch], stats)
      for b, o in zip(batch, outs):
        done[id(b)] = o
      del parts, outs
      if not last and pending is None:
        pending = pool.submit(read, cut[i + 1])  # after this batch's freed
  finally:
    if pending is not None:  # a round or exchange failed: no read outlives us
      concurrent.futures.wait([pending])
    pool.shutdown(wait=True)
  for i in pos:
    leaves[i] = done[id(leaves[i])]
  return tree_util.tree_unflatten(treedef, leaves)


def has_deferred(result: Any) -> bool:
  return any(isinstance(x, Deferred) for x in tree_util.tree_leaves(
      result, is_leaf=lambda x: isinstance(x, Deferred)))


# ---- lazy leaves (read later, one collective read per leaf) ------------------

LAZY_ORDER = (
    "Reads of lazy leaves that are read once are collective: every process "
    "must read the same leaves, with the same sharding and dtype, in the "
    "same order (as it calls a jitted function over global arrays); nothing "
    "was exchanged, and later reads in the same order work")


def exchange_signature(restore: str, path: str, shape, dtype, sharding) -> str:
  """What one lazy read-once read exchanges, the same on every process
  that reads the same leaf alike: the restore, the leaf, its shape and
  dtype, and the sharding (mesh axes and sizes, PartitionSpec)."""
  mesh = getattr(sharding, "mesh", None)
  where = (f"{type(sharding).__name__}(mesh {dict(mesh.shape)}, "
           f"spec {getattr(sharding, 'spec', None)})" if mesh is not None
           else repr(sharding))
  return (f"leaf {path!r} of {restore}, shape {tuple(shape)}, "
          f"dtype {np.dtype(dtype).name}, {where}")


@dataclasses.dataclass
class LazyReads:
  """What a ``restore(lazy=True)`` gives its leaves: the restore's counter
  and stats (their later reads add to them), the Checkpointer's rounds for
  leaves read once (None: no leaf of this restore is read once), and the
  bound of their reads' stalls."""
  counter: ReadCounter
  stats: RestoreStats
  rounds: "LazyRounds | None" = None
  name: str = ""  # the restore, the same on every process (its call key)
  meter: storemeter.Meter = dataclasses.field(
      default_factory=storemeter.Meter)
  # The bound of each later read's stalls (ckpt/store/deadline.py), made
  # afresh for each read; None: unbounded.
  deadline: Callable[[], Any] = lambda: None

  def update(self) -> None:
    self.stats.add_reads(self.counter)
    self.stats.fetched_bytes = self.meter.value
    if not multihost.is_multiprocess():
      self.stats.fetched_bytes_all = self.stats.fetched_bytes


class LazyRounds:
  """The failure rounds of one Checkpointer's read-once lazy reads.

  Every process calls the reads in the same order, so the n-th read on each
  process takes ticket n and names round ``{base}/{n}``. The collective part
  of a read (the round, then the exchange) waits for its ticket's turn, so
  reads that overlap (``asyncio.gather`` of ``read_async``) still issue
  their collectives in the order they were called. When round n passes,
  every process is done with the earlier rounds: their keys are deleted.
  """

  def __init__(self, base: str, timeout_s: float):
    self.base = base
    self.timeout_s = timeout_s
    self._cond = threading.Condition()
    self._issued = 0
    self._turn = 0
    self._pending: list[str] = []  # round keys not deleted yet
    self._abandoned: set[int] = set()

  def ticket(self) -> int:
    with self._cond:
      self._issued += 1
      return self._issued - 1

  def collective(self, ticket: int, error: BaseException | None, what: str,
                 fn: Callable[[], Any], same: str = "",
                 tally: Callable[[], int] | None = None,
                 tallied: Callable[[int], None] | None = None) -> Any:
    """In ``ticket``'s turn: the round (every process raises if any failed,
    or if they are not about to exchange the ``same`` leaf), then ``fn()``
    (the exchange) when none did. ``tally()``: a count this process posts
    in the round; ``tallied(sum over the processes)`` gets their sum."""
    with self._cond:
      while self._turn != ticket:
        self._cond.wait()
    try:
      key = f"{self.base}/{ticket}"
      self._pending.append(key)
      sums = multihost.all_ok(key, error, what, self.timeout_s, same=same,
                              differ=LAZY_ORDER,
                              tally=None if tally is None else tally())
      if tallied is not None and sums:
        tallied(sum(sums.values()))
      done, self._pending = self._pending[:-1], self._pending[-1:]
      for k in done:
        multihost.forget(k)
      return fn()
    finally:
      with self._cond:
        self._turn += 1
        self._cond.notify_all()

  def abandon(self, ticket: int, error: BaseException, what: str) -> None:
    """A read given up before its round (cancelled, interrupted): its round
    still runs, with the error, on a thread of its own, so the other
    processes raise instead of waiting for this one, and later reads get
    their turn."""
    with self._cond:
      if ticket in self._abandoned:
        return
      self._abandoned.add(ticket)

    def run():
      try:
        self.collective(ticket, error, what, lambda: None)
      except BaseException:  # pylint: disable=broad-except
        pass  # the error is the caller's, already raised there
    threading.Thread(target=run, name="ckpt-readonce-abandon",
                     daemon=True).start()


@dataclasses.dataclass
class LazyPlan:
  """A lazy leaf that reads once when read with ``sharding`` (the one it
  was bound to): its part of ``split``, then the exchange."""
  sharding: Any
  split: Any  # readsplit.EvenSplit | readsplit.ChunkSplit
  reads: LazyReads
  rounds: LazyRounds  # the Checkpointer's (reads.rounds, never None here)

  def applies(self, sharding) -> bool:
    return sharding is not None and (sharding is self.sharding or
                                     sharding == self.sharding)

  def finish(self, ticket: int, part: readsplit.Part | None,
             error: BaseException | None, path: str, shape, dtype
             ) -> jax.Array:
    """The round, then the exchange of ``part`` into ``sharding``; on the
    calling thread (a collective). The round checks that every process
    exchanges this same leaf alike (never mixed data), and carries what
    each fetched so far (``fetched_bytes_all``)."""
    stats = self.reads.stats

    def tallied(total: int) -> None:
      stats.fetched_bytes_all = total
    return self.rounds.collective(
        ticket, error, f"read of lazy leaf {path!r}",
        lambda: exchange([part], [self.sharding], stats)[0],
        same=exchange_signature(self.reads.name, path, shape, dtype,
                                self.sharding),
        tally=lambda: self.reads.meter.value, tallied=tallied)
