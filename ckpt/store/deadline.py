"""One deadline for a whole operation against a store (a save, a query).

TensorStore bounds each request by its retries (ckpt/store/storage.py), but a
save is many requests in sequence (arrays, data, per-process files, index,
marker, records, removal of a failed attempt), so a store that dies during
one takes the sum of their bounds: measured with a moto server behind a
proxy that stops after an async ``save()`` returned, 162 s before
``wait_until_finished()`` raised; and against a server that accepts
connections and never answers (curl has no timeout by default) no request
ends at all: no answer after 400 s, neither from the save nor from a new
Checkpointer's ``latest_step()``.

So the Checkpointer gives each operation a deadline (``save_timeout_s``,
``query_timeout_s``) and ``scope`` makes it the deadline of everything done
under it: a ``ContextVar``, which asyncio tasks and ``asyncio.to_thread``
copy, so the writes, the lease renewal, the commit and the removal of a
failed attempt that a save starts on its loop and in worker threads all
share it. Every wait for the store checks it:

- ``tsfuture.wait`` (awaits) gives up at the deadline without cancelling
  the TensorStore future (cancelling can freeze the process, see
  ckpt/store/tsfuture.py): the operation is abandoned, goes on inside TensorStore
  until it ends on its own (its retries), and its late result or error is
  dropped;
- ``result`` (blocking calls of ckpt/store/storage.py) waits with ``timeout=``
  the time left, which does not cancel anything either.

A wait past the deadline raises ``StoreTimeoutError`` (a CheckpointError)
naming the operation, the URL, the bound and the option that sets it.
Without a scope (or with a bound of None) nothing changes: waits last as
long as TensorStore's retries.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import time
from typing import Any, Callable, Iterator

from ckpt.errors import StoreTimeoutError

_CURRENT: contextvars.ContextVar["Deadline | None"] = contextvars.ContextVar(
    "ckpt_deadline", default=None)


@dataclasses.dataclass(frozen=True)
class Deadline:
  """When an operation must be over.

  ``operation`` names it with its URL ("writing step 5 to 's3://b/run'");
  None lets the store call in flight name it ("listing the steps of
  's3://b/run'"). ``option`` is the Checkpointer argument that sets
  ``bound_s``."""
  at: float  # time.monotonic()
  bound_s: float
  option: str
  operation: str | None = None

  @classmethod
  def start(cls, bound_s: float | None, option: str,
            operation: str | None = None) -> "Deadline | None":
    """A deadline ``bound_s`` from now (None: no bound)."""
    if bound_s is None:
      return None
    return cls(time.monotonic() + bound_s, bound_s, option, operation)

  def left(self) -> float:
    return self.at - time.monotonic()

  def error(self, doing: str | None = None,
            failure: BaseException | None = None) -> StoreTimeoutError:
    """The error of a wait that ran past this deadline; ``doing`` is the
    store call it was waiting for ("reading the index of step 5 from
    's3://b/run'"), when known; ``failure`` an earlier error of the
    operation, when the deadline cut what followed it."""
    what = self.operation or doing or "an operation on the store"
    message = (f"{what} did not finish within {self.bound_s:g} s: the store "
               "did not answer in time")
    if self.operation and doing:
      message += f" (it was waiting for {doing})"
    if failure is not None:
      message += f"; it had failed with {type(failure).__name__}: {failure}"
    message += (f". The bound is the Checkpointer argument {self.option}="
                f"{self.bound_s:g}; pass a larger value to wait longer, or "
                "None to wait as long as the store's retries take")
    e = StoreTimeoutError(message)
    e.deadline, e.doing = self, doing
    return e


def current() -> Deadline | None:
  """The deadline of the operation in progress here (None: unbounded)."""
  return _CURRENT.get()


def time_left() -> float | None:
  """Seconds left before the current deadline (never negative), or None."""
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
  """Awaits ``coro`` under ``deadline``. A failure that a wait past the
  deadline caused (a StoreTimeoutError in its chain, perhaps wrapped by the
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
      if (deadline is not None and deadline.left() <= 0
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
  """``future.result()`` (a TensorStore future) within the current deadline;
  past it raises ``StoreTimeoutError`` (the future goes on, not cancelled).
  Inside ``Storage.store_errors`` the error then names the store call."""
  d = _CURRENT.get()
  if d is None:
    return future.result()
  try:
    return future.result(timeout=max(0.0, d.left()))
  except TimeoutError:
    if future.done():
      raise  # the operation's own error
    raise d.error() from None


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
