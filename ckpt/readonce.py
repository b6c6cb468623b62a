"""Read once, spread the reading: restore onto a mesh with replicas.

With a target NamedSharding, the mesh axes its spec does not use are replica
axes: the processes along them hold the same boxes. Read naively, each of
them reads every box it holds from storage, so a restore with R replica
processes pulls R times the checkpoint. Here each leaf is instead read with
a *read sharding*: the target spec with one dimension further split over the
replica axes that span processes, so every process reads a distinct 1/R of
each box (all reads together = each box once). The parts are then
exchanged with one ``jax.jit`` identity program whose ``out_shardings`` are
the target shardings: XLA inserts the all-gather over the replica devices
(gloo across processes on CPU). The result is bit-exact and has exactly the
target's sharding.

Every process must issue the same collectives in the same order, so every
decision here is computed from information all processes share: the target
shardings (global meshes), leaf shapes and dtypes (from the one index), the
policy option (checked equal by the restore's agreement round) and the
storage kind. The exchange runs on the caller's thread (never the
Checkpointer's background thread), in batches whose host bytes (the parts
read plus the gathered boxes) stay within ``concurrent_bytes``; a batch is
read (background thread, under the byte limiter), exchanged, and its parts
freed before the next one is read.

Not read once (the normal read, each process its own boxes): leaves with no
NamedSharding target, no replica axis across processes, no dimension that
divides by the replica count, typed PRNG keys and values already in memory
(inline leaves, fallback values).

Lazy leaves (``restore(lazy=True)``) read once too, when they are read
later: a leaf the restore would have read once carries a ``LazyPlan``, and
its ``read()`` / ``read_async()`` with the sharding it was bound to reads
this process's part with the read sharding, runs the failure round and
exchanges that one leaf (``LazyPlan.finish``). That read is a collective
call: every process reads the same leaves in the same order. The rounds of
one Checkpointer's lazy reads (``LazyRounds``) are numbered in the order
the reads are called, and their collective part runs in that order even
when reads overlap (``asyncio.gather`` of ``read_async``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import tree_util
from jax.sharding import NamedSharding, PartitionSpec

from ckpt import multihost


# The automatic policy (read_once=None), chosen from scripts/bench.py's
# multi-process restore figures (see README "Read once"): on an object
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

class ReadCounter:
  """Bytes this process read from stored arrays in one restore: the boxes
  asked of TensorStore (in the stored dtype) and the whole stored chunks
  those boxes touch (what an uncompressed store must fetch)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.bytes_read = 0
    self.chunk_bytes_read = 0
    self.reads = 0
    self.peak_in_use = 0  # the most a byte limiter of the restore granted

  def add(self, nbytes: int, chunk_bytes: int) -> None:
    with self._lock:
      self.bytes_read += int(nbytes)
      self.chunk_bytes_read += int(chunk_bytes)
      self.reads += 1

  def note(self, limiter) -> None:
    """Records the peak of a ByteLimiter the restore used."""
    with self._lock:
      self.peak_in_use = max(self.peak_in_use, int(limiter.peak_in_use))


def note_limiter(limiter) -> None:
  """Records ``limiter``'s peak in the restore's counter (if counting)."""
  c = COUNTER.get()
  if c is not None:
    c.note(limiter)


# Set for the duration of a restore; asyncio tasks and to_thread inherit it.
COUNTER: contextvars.ContextVar[ReadCounter | None] = contextvars.ContextVar(
    "ckpt_read_counter", default=None)


async def counted(coro, counter: ReadCounter | None):
  """Runs ``coro`` with ``counter`` counting its storage reads."""
  COUNTER.set(counter)
  return await coro


def count(box_start: Sequence[int], box_stop: Sequence[int],
          chunks: Sequence[int], itemsize: int) -> None:
  c = COUNTER.get()
  if c is None:
    return
  n = math.prod(b - a for a, b in zip(box_start, box_stop)) * itemsize
  touched = 1
  for a, b, k in zip(box_start, box_stop, chunks):
    if b <= a:
      touched = 0
      break
    touched *= ((b - 1) // k - a // k + 1) * k
  c.add(n, touched * itemsize)


@dataclasses.dataclass
class RestoreStats:
  """What the last ``Checkpointer.restore`` did on this process.

  bytes_read: bytes of the boxes read from stored arrays (stored dtype);
  chunk_bytes_read: of the whole stored chunks those boxes touch;
  read_once_leaves: leaves read once and exchanged; exchanged_bytes: bytes
  this process's devices received from the exchange (gathered boxes minus
  the parts read here); exchange_s: time in the exchange programs;
  batches: how many exchange programs (batches); peak_read_bytes: the most
  bytes the restore's byte limiters had granted at once (reads in flight,
  at most ``concurrent_bytes``); peak_batch_bytes: the largest exchange
  batch, measured: bytes of this process's device buffers of the batch's
  parts read plus its gathered arrays (within ``concurrent_bytes`` unless
  one leaf alone is larger); total_s: the whole call.

  A ``lazy=True`` restore's stats keep growing as its leaves are read (the
  bytes they read, and for leaves read once their exchange); total_s stays
  the restore call's.
  """
  read_once: bool | None = None
  bytes_read: int = 0
  chunk_bytes_read: int = 0
  reads: int = 0
  read_once_leaves: int = 0
  exchanged_bytes: int = 0
  exchange_s: float = 0.0
  batches: int = 0
  peak_read_bytes: int = 0
  peak_batch_bytes: int = 0
  total_s: float = 0.0

  def add_reads(self, counter: ReadCounter) -> None:
    """Takes the counts of ``counter`` (this restore's)."""
    self.bytes_read = counter.bytes_read
    self.chunk_bytes_read = counter.chunk_bytes_read
    self.reads = counter.reads
    self.peak_read_bytes = max(self.peak_read_bytes, counter.peak_in_use)


# ---- the read sharding -------------------------------------------------------

def _entry_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, (tuple, list)):
    return tuple(entry)
  return (entry,)


def _spanning_axes(mesh) -> tuple[str, ...]:
  """Mesh axes along which the process index changes."""
  procs = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
  out = []
  for i, name in enumerate(mesh.axis_names):
    if mesh.devices.shape[i] > 1 and (
        procs != np.take(procs, [0], axis=i)).any():
      out.append(name)
  return tuple(out)


_SPAN_CACHE: dict[Any, tuple] = {}


def replica_plan(sharding, shape: Sequence[int], chunks: Sequence[int] | None,
                 min_r: int | None):
  """(read sharding, replica count) for one leaf, or None: normal read.

  The replica axes are the mesh axes the spec does not use and along which
  the process changes; one dimension whose per-device extent divides by
  their product gets them appended (a dimension on which the parts fall on
  stored chunk boundaries preferred, then the longest part).
  """
  if min_r is None or not isinstance(sharding, NamedSharding):
    return None
  mesh = sharding.mesh
  if not hasattr(mesh, "devices") or jax.process_count() == 1:
    return None
  key = id(mesh), mesh
  if key not in _SPAN_CACHE:
    procs = {d.process_index for d in mesh.devices.flat}
    _SPAN_CACHE[key] = (_spanning_axes(mesh), len(procs) == jax.process_count())
  spanning, all_procs = _SPAN_CACHE[key]
  if not all_procs:  # a collective on a mesh of some processes: not here
    return None
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  used = {a for e in spec for a in _entry_axes(e)}
  axes = tuple(a for a in spanning if a not in used)
  r = math.prod(mesh.shape[a] for a in axes) if axes else 1
  if r < max(2, min_r):
    return None
  best, best_key = None, None
  for d, n in enumerate(shape):
    k = math.prod(mesh.shape[a] for a in _entry_axes(spec[d]))
    if n % (k * r):
      continue
    part = n // (k * r)
    aligned = bool(chunks) and part % chunks[d] == 0
    score = (aligned, part)
    if best_key is None or score > best_key:
      best, best_key = d, score
  if best is None:
    return None
  new = list(spec)
  new[best] = _entry_axes(spec[best]) + axes
  read = NamedSharding(mesh, PartitionSpec(*new),
                       memory_kind=sharding.memory_kind)
  return read, r


def _per_process_bytes(sharding, shape, itemsize: int, r: int) -> int:
  """An upper bound on the host bytes one process holds for one leaf while
  it is exchanged (its parts read + its gathered boxes), from global
  information only (the same number on every process)."""
  mesh = sharding.mesh
  spec = tuple(sharding.spec)
  shards = math.prod(mesh.shape[a] for e in spec for a in _entry_axes(e))
  per_device = math.prod(shape) * itemsize // max(1, shards)
  devices = max(1, mesh.devices.size // jax.process_count())
  return per_device * devices + (per_device * devices) // r


@dataclasses.dataclass
class Deferred:
  """A leaf to read with ``read_sharding`` and exchange into ``sharding``
  (a placeholder in the tree restore_tree returns)."""
  name: str
  src: Any  # LazyLeaf
  out_dtype: np.dtype
  sharding: Any
  read_sharding: Any
  cost: int


def deferred(name: str, src, out_dtype, sharding, min_r: int | None
             ) -> Deferred | None:
  shape = tuple(src.shape)
  chunks = getattr(getattr(src, "entry", None), "chunks", None)
  plan = replica_plan(sharding, shape, tuple(chunks) if chunks else None,
                      min_r)
  if plan is None:
    return None
  read, r = plan
  return Deferred(name, src, np.dtype(out_dtype), sharding, read,
                  _per_process_bytes(sharding, shape,
                                     np.dtype(out_dtype).itemsize, r))


# ---- the exchange (caller's thread) -----------------------------------------

def _identity(*xs):
  return xs


def exchange(parts: Sequence[jax.Array], shardings: Sequence[Any],
             stats: RestoreStats) -> tuple[jax.Array, ...]:
  """One jit identity program: each part (read with its read sharding) into
  its target sharding; XLA all-gathers over the replica devices. A
  collective: on the caller's thread, in the same order on every process."""
  t0 = time.perf_counter()
  fn = jax.jit(_identity, out_shardings=tuple(shardings))
  outs = fn(*parts)
  jax.block_until_ready(outs)
  stats.exchange_s += time.perf_counter() - t0
  stats.batches += 1
  held = 0
  for p, o in zip(parts, outs):
    got = sum(s.data.nbytes for s in o.addressable_shards)
    mine = sum(s.data.nbytes for s in p.addressable_shards)
    stats.exchanged_bytes += max(0, got - mine)
    held += got + mine
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


def finish(result: Any, read: Callable[[list[Deferred]], list[jax.Array]],
           budget: int, stats: RestoreStats,
           check: Callable[[int, BaseException | None], None] = (
               lambda i, e: None)) -> Any:
  """Replaces every Deferred leaf of ``result`` by its exchanged array.

  ``read(batch)`` reads a batch with its read shardings (on the background
  thread, under the byte limiter); ``check(i, error)`` is a round in which
  every process says whether batch i was read (``multihost.all_ok``); the exchange
  runs here, on the caller's thread, one jit program per batch.
  """
  leaves, treedef = tree_util.tree_flatten(
      result, is_leaf=lambda x: isinstance(x, Deferred))
  pos = [i for i, x in enumerate(leaves) if isinstance(x, Deferred)]
  if not pos:
    return result
  items = [leaves[i] for i in pos]
  done: dict[int, jax.Array] = {}
  for i, batch in enumerate(batches(items, budget)):
    parts, error = None, None
    try:
      parts = read(batch)
    except Exception as e:  # pylint: disable=broad-except
      error = e
    check(i, error)
    outs = exchange(parts, [b.sharding for b in batch], stats)
    for b, o in zip(batch, outs):
      done[id(b)] = o
    del parts, outs
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
  and stats (their later reads add to them), and the Checkpointer's rounds
  for leaves read once (None: no leaf of this restore is read once)."""
  counter: ReadCounter
  stats: RestoreStats
  rounds: "LazyRounds | None" = None
  name: str = ""  # the restore, the same on every process (its call key)

  def update(self) -> None:
    self.stats.add_reads(self.counter)


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
                 fn: Callable[[], Any], same: str = "") -> Any:
    """In ``ticket``'s turn: the round (every process raises if any failed,
    or if they are not about to exchange the ``same`` leaf), then ``fn()``
    (the exchange) when none did."""
    with self._cond:
      while self._turn != ticket:
        self._cond.wait()
    try:
      key = f"{self.base}/{ticket}"
      self._pending.append(key)
      multihost.all_ok(key, error, what, self.timeout_s, same=same,
                       differ=LAZY_ORDER)
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
  was bound to): its part with ``read_sharding``, then the exchange."""
  sharding: Any
  read_sharding: Any
  reads: LazyReads
  rounds: LazyRounds  # the Checkpointer's (reads.rounds, never None here)

  def applies(self, sharding) -> bool:
    return sharding is not None and (sharding is self.sharding or
                                     sharding == self.sharding)

  def finish(self, ticket: int, part: jax.Array | None,
             error: BaseException | None, path: str, shape, dtype
             ) -> jax.Array:
    """The round, then the exchange of ``part`` into ``sharding``; on the
    calling thread (a collective). The round checks that every process
    exchanges this same leaf alike (never mixed data)."""
    return self.rounds.collective(
        ticket, error, f"read of lazy leaf {path!r}",
        lambda: exchange([part], [self.sharding], self.reads.stats)[0],
        same=exchange_signature(self.reads.name, path, shape, dtype,
                                self.sharding))
