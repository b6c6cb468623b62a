"""One bound on the stalls of an operation against a store (a save, a query, a
restore's reads): the time it may go without progress, not its length.

TensorStore bounds each request by its retries (ckpt/store/storage.py), but a
save is many requests in sequence (arrays, data, per-process files, index,
marker, records, removal of a failed attempt), so a store that dies during
one takes the sum of their bounds: measured with a moto server behind a
proxy that stops after an async ``save()`` returned, 162 s before
``wait_until_finished()`` raised; and against a server that accepts
connections and never answers (curl has no timeout by default) no request
ends at all: no answer after 400 s, neither from the save nor from a new
Checkpointer's ``latest_step()``.

So the Checkpointer gives each operation a ``Deadline`` (``save_timeout_s``
for saves, ``query_timeout_s`` for queries and restore reads) and ``scope``
makes it the deadline of everything done under it: a ``ContextVar``, which
asyncio tasks and ``asyncio.to_thread`` copy, so the writes, the lease
renewal, the commit and the removal of a failed attempt that a save starts on
its loop and in worker threads all share it.

The bound is on stalls, not on size: an operation fails once ``bound_s``
passed with no progress, where progress is any of

- a wait of this operation for the store that ended well (``tsfuture.wait``,
  ``result``);
- data moving between this process and its stores
  (ckpt/store/traffic.py, polled at most every ``POLL_S``): requests that
  completed, as TensorStore's kvstore drivers count them (the requests
  inside one TensorStore write or read of many chunks count one by one),
  and, on object stores, the bytes of the requests in flight, as the
  kernel counts them on the connections to the store. A lease renewal
  (ckpt/commit/renewal.py) is none: each of its requests is announced
  (``traffic.aside``) and discounted;
and the time the operation spends waiting for other processes (a
barrier, which has its own bound, ``barrier_timeout_s``) does not count
(``exclude``).

So a healthy save or restore of any size at any steady rate completes,
even when one request takes longer than the bound (measured: chunks of
768 KiB through 256 KiB/s against a bound of 2 s, no renewal during the
save, tests/objectstore/test_own_progress.py), while a store that stops
answering fails it ``bound_s`` after its last byte moved, and so does a
store that swallows the uploads but answers the renewals (2.1 s with a
bound of 2 s and a renewal every second; before, the renewals kept such a
save alive forever, and a request longer than the bound failed a healthy
one). On a disk, where no bytes are seen in flight, the granularity is one
request. The counts are per process: another operation of this process
moving data through the same driver or to the same store counts as
progress too.

Every wait for the store checks it:

- ``tsfuture.wait`` (awaits) gives up at the stall bound without cancelling
  the TensorStore future (cancelling can freeze the process, see
  ckpt/store/tsfuture.py): the operation is abandoned, goes on inside
  TensorStore until it ends on its own (its retries), and its late result
  or error is dropped;
- ``result`` (blocking calls of ckpt/store/storage.py) waits with
  ``timeout=``, which does not cancel anything either.

Either wait wakes every quarter of the bound (at least ``POLL_S``) to look
at the counters (``slice``): a progress seen at a poll counts from the
previous poll (the earliest it can have happened), so an operation whose
store died fails within the bound of its last answer, and one that makes
progress at least every three quarters of the bound never fails; a wait of
a healthy operation wakes four times per bound, not at every poll.

A wait that gives up raises ``StoreTimeoutError`` (a CheckpointError)
naming the operation, the URL, what it waited for, how long nothing
progressed, the bound and the option that sets it; from then on the
operation's deadline has expired: every later wait under it gives up at
once. Without a scope (or with a bound of None) nothing changes: waits last
as long as TensorStore's retries.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
import time
from typing import Any, Callable, Iterator

from ckpt.errors import StoreTimeoutError
from ckpt.store import traffic

_CURRENT: contextvars.ContextVar["Deadline | None"] = contextvars.ContextVar(
    "ckpt_deadline", default=None)
# How often a wait looks at TensorStore's counters (and the clock).
POLL_S = 0.5


class Deadline:
  """How long an operation may go without progress (module docstring).

  ``operation`` names it with its URL ("writing step 5 to 's3://b/run'");
  None lets the store call in flight name it ("listing the steps of
  's3://b/run'"). ``option`` is the Checkpointer argument that sets
  ``bound_s``. Shared by the operation's tasks and threads."""

  def __init__(self, bound_s: float, option: str,
               operation: str | None = None, on_wire: bool = True):
    self.bound_s = bound_s
    self.option = option
    self.operation = operation
    self._on_wire = on_wire  # its store is reached over the network
    self._lock = threading.Lock()
    self._last = time.monotonic()  # the last progress
    self._seen = traffic.moved(on_wire)  # the most data moved, seen at a poll
    self._polled = self._last
    self.expired = False           # a wait gave up: every later one does
    self._abandoned: list = []     # TensorStore futures given up on

  @classmethod
  def start(cls, bound_s: float | None, option: str,
            operation: str | None = None, on_wire: bool = True
            ) -> "Deadline | None":
    """A bound of ``bound_s`` without progress, from now (None: none).
    ``on_wire=False``: its store is a local disk (traffic.moved)."""
    if bound_s is None:
      return None
    return cls(bound_s, option, operation, on_wire)

  def progress(self) -> None:
    """The operation moved on: its stall clock starts again."""
    with self._lock:
      self._last = time.monotonic()

  def exclude(self, seconds: float) -> None:
    """``seconds`` just spent waiting for something else than the store
    (other processes, at a barrier) do not count as a stall."""
    with self._lock:
      self._last = min(time.monotonic(), self._last + max(0.0, seconds))

  def left(self) -> float:
    """Seconds until the operation has stalled for ``bound_s`` (<= 0: it
    has; 0 once expired). Looks at TensorStore's counters at most every
    ``POLL_S``: a request completed since counts as progress."""
    now = time.monotonic()
    if self.expired:
      return 0.0
    with self._lock:
      poll = now - self._polled >= POLL_S or now - self._last >= self.bound_s
    if poll:
      seen = traffic.moved(self._on_wire)
      with self._lock:
        if seen > self._seen:
          # It happened after the previous look, maybe just after it: the
          # earliest time counts, so a store that died is given up within
          # the bound of its last answer, never a poll's slice later.
          self._seen = seen
          self._last = max(self._last, self._polled)
        self._polled = now
    with self._lock:
      return self._last + self.bound_s - now

  def abandon(self, future: Any) -> None:
    """A wait gave up on ``future`` (a TensorStore future), which goes on
    inside TensorStore until its retries end."""
    with self._lock:
      self._abandoned = [f for f in self._abandoned if not f.done()]
      self._abandoned.append(future)

  def settled(self) -> bool:
    """Whether every request this process gave up on has ended (so no
    late write of the operation can still land)."""
    with self._lock:
      self._abandoned = [f for f in self._abandoned if not f.done()]
      return not self._abandoned

  def slice(self, left: float) -> float:
    """How long a wait sleeps before it looks again, ``left`` seconds
    before the bound (``left()``)."""
    return max(0.0, min(left, max(POLL_S, self.bound_s / 4)))

  def stalled_s(self) -> float:
    """Seconds since the last progress."""
    with self._lock:
      return time.monotonic() - self._last

  def error(self, doing: str | None = None,
            failure: BaseException | None = None) -> StoreTimeoutError:
    """The error of a wait that gave up (and the deadline expires); ``doing``
    is the store call it was waiting for ("reading the index of step 5
    from 's3://b/run'"), when known; ``failure`` an earlier error of the
    operation, when the deadline cut what followed it."""
    self.expired = True
    what = self.operation or doing or "an operation on the store"
    message = (f"{what} stalled: nothing it waited for from the store "
               f"completed for {self.stalled_s():.1f} s (no request "
               f"completed, no byte of its data moved), more than the "
               f"{self.bound_s:g} s allowed without progress")
    if self.operation and doing:
      message += f" (it was waiting for {doing})"
    if failure is not None:
      message += f"; it had failed with {type(failure).__name__}: {failure}"
    message += (f". The bound is the Checkpointer argument {self.option}="
                f"{self.bound_s:g} (the longest time without progress, not "
                "the length of the operation); pass a larger value to wait "
                "longer, or None to wait as long as the store's retries take")
    e = StoreTimeoutError(message)
    e.deadline, e.doing = self, doing
    return e


def current() -> Deadline | None:
  """The deadline of the operation in progress here (None: unbounded)."""
  return _CURRENT.get()


def time_left() -> float | None:
  """Seconds until the current operation has stalled for its bound (never
  negative), or None."""
  d = _CURRENT.get()
  return None if d is None else max(0.0, d.left())


@contextlib.contextmanager
def scope(deadline: Deadline | None) -> Iterator[None]:
  """Makes ``deadline`` the current one here and in every task and thread
  started from here (None: no bound, even inside a bounded operation)."""
  token = _CURRENT.set(deadline)
  try:
    yield
  finally:
    _CURRENT.reset(token)


def call(deadline: Deadline | None, fn: Callable[..., Any], *args) -> Any:
  """``fn(*args)`` under ``deadline``."""
  with scope(deadline):
    return fn(*args)


async def bounded(coro, deadline: Deadline | None) -> Any:
  """Awaits ``coro`` under ``deadline``. A failure that a wait that gave up
  caused (a StoreTimeoutError in its chain, perhaps wrapped by the
  code in between) comes out as that StoreTimeoutError, so the caller sees
  the operation, the bound and its option first; so does one that arrives
  after the deadline (a request that failed after its retries, and then
  the removal of the failed attempt was cut), with that failure in it."""
  with scope(deadline):
    try:
      return await coro
    except Exception as e:
      timeout = timeout_in(e)
      if timeout is e:
        raise
      if timeout is not None and timeout.deadline is not None:
        raise timeout.deadline.error(timeout.doing) from e
      if (deadline is not None and (deadline.expired or deadline.left() <= 0)
          and not abandoned(e)):  # (another process's deadline: as it is)
        raise deadline.error(failure=e) from e
      raise


def timeout_in(e: BaseException | None) -> StoreTimeoutError | None:
  """The StoreTimeoutError in ``e``'s chain (causes and contexts), if any."""
  seen = 0
  while e is not None and seen < 16:
    if isinstance(e, StoreTimeoutError):
      return e
    e, seen = e.__cause__ or e.__context__, seen + 1
  return None


def abandoned(e: BaseException) -> bool:
  """Whether the failure ``e`` of a save comes from a deadline, here or on
  another process (whose failure arrives as text naming its type): then
  some process may have abandoned writes into the attempt that TensorStore
  still sends, so nothing may remove the attempt now (cleanup does, later,
  from its ``pending/`` record)."""
  return (timeout_in(e) is not None
          or f"{StoreTimeoutError.__name__}: " in str(e))


def result(future: Any) -> Any:
  """``future.result()`` (a TensorStore future) within the current deadline:
  after ``bound_s`` without progress raises ``StoreTimeoutError`` (the
  future goes on, not cancelled); its result is progress.
  Inside ``Storage.store_errors`` the error then names the store call."""
  d = _CURRENT.get()
  if d is None:
    return future.result()
  while True:
    left = d.left()
    if left <= 0:
      d.abandon(future)
      raise d.error() from None
    try:
      got = future.result(timeout=d.slice(left))
    except TimeoutError:
      if future.done():
        raise  # the operation's own error
      continue
    d.progress()
    return got


def check_bound(name: str, value: Any) -> float | None:
  """A Checkpointer argument that bounds an operation: seconds > 0, or None
  (no bound)."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      math.isfinite(value) and value > 0):
    raise ValueError(f"{name} must be a positive number of seconds or None "
                     f"(no bound), got {value!r}")
  return float(value)
