"""The background loop of a Checkpointer or a LocalTier: starting it, running on it, closing it.

``BackgroundLoop`` owns one asyncio event loop on one background thread (at a
lower priority, ckpt/save/polite.py), the close that a job ending without
``close()`` still gets (so that its last save commits), and the guard of a
``close`` racing a save on another thread. It is the one concurrency model of
ckpt: a ``Checkpointer`` runs every TensorStore call, barrier and retention
step of a save on it; a ``LocalTier`` runs its writer there.

A ``close`` racing a ``save`` on another thread: a save that has passed its
entry (``enter``) is waited for by close, to its commit or its failure, like
a save in flight; a save that enters once close has begun is refused at once
("closed"), before anything is written. So the loop never stops under a save
that still needs it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
import weakref
from typing import Any, Callable, Coroutine

from absl import logging

from ckpt.save import polite
from ckpt.errors import CheckpointError


class BackgroundLoop:
  """One event loop on one background thread, and how it closes.

  Args:
    owner: what the errors name ("Checkpointer", "LocalTier").
    on_exit: the owner's ``close``, called at interpreter exit if the
      owner was not closed (held weakly: a dropped owner is not kept).
    name: the thread's name.
  """

  def __init__(self, owner: str, on_exit: Callable[[], None] | None = None,
               name: str = "ckpt-background"):
    self.owner = owner
    self.closed = False
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=_run_loop, args=(self._loop,),
                                    name=name, daemon=True)
    self._thread.start()
    # close() racing save(): the saves between their entry and their
    # registration in flight (thread ident -> count), and whether close
    # has begun (then no save enters).
    self._entry = threading.Condition()
    self._entered: dict[int, int] = {}
    self._closing = False
    self._closed_event = threading.Event()
    if on_exit is not None:
      # A job that ends without close() still finishes (commits) its last
      # save. It must run before the interpreter stops thread pools
      # (asyncio.to_thread refuses work after that), which plain atexit
      # handlers do not.
      concurrent.futures.ThreadPoolExecutor  # pylint: disable=pointless-statement
      # (imports the pool module now, so its exit hook is older and runs after)
      getattr(threading, "_register_atexit", atexit.register)(
          _close_at_exit, weakref.ref(self), weakref.WeakMethod(on_exit))

  # ---- running ----------------------------------------------------------

  def submit(self, coro: Coroutine) -> concurrent.futures.Future:
    """Starts ``coro`` on the loop; its future."""
    return asyncio.run_coroutine_threadsafe(coro, self._loop)

  def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
    """Runs ``coro`` on the loop and waits for its result."""
    return self.submit(coro).result(timeout)

  def call(self, fn: Callable[[], Any]) -> None:
    """Calls ``fn`` on the loop's thread, between its tasks."""
    self._loop.call_soon_threadsafe(fn)

  @property
  def native_id(self) -> int | None:
    """The background thread's id for the OS (its priority)."""
    return self._thread.native_id

  def check_open(self) -> None:
    if self.closed:
      raise CheckpointError(f"this {self.owner} is closed")

  # ---- a save's entry, and close ----------------------------------------

  def enter(self, step: int) -> None:
    """The entry of a save: refused (CheckpointError) once close has
    begun; else close waits for this save until ``leave``."""
    with self._entry:
      if self._closing:
        raise CheckpointError(
            f"save({step}) refused: this {self.owner} is closed, or being "
            "closed by close() on another thread; nothing was written")
      me = threading.get_ident()
      self._entered[me] = self._entered.get(me, 0) + 1

  def leave(self) -> None:
    """The save is in flight (close waits for it as such) or over."""
    with self._entry:
      me = threading.get_ident()
      self._entered[me] -= 1
      if not self._entered[me]:
        del self._entered[me]
      self._entry.notify_all()

  def close(self, before: Callable[[], None]) -> None:
    """Waits for the saves that entered, calls ``before`` (the owner's
    wait for its work), then cancels what is left on the loop and stops it.
    Idempotent; a second thread's close waits for the first one's."""
    me = threading.get_ident()
    with self._entry:
      if self._entered.get(me):
        raise CheckpointError(
            "close() was called inside save() on the same thread (a save "
            "transform?): the save must end first; nothing was closed")
      closing, self._closing = self._closing, True
      while self._entered:  # saves that entered before: they go on
        self._entry.wait()
    if closing:  # another thread closes: done once it is
      self._closed_event.wait()
      return
    try:
      self._close_now(before)
    finally:
      self._closed_event.set()

  def _close_now(self, before: Callable[[], None]) -> None:
    if self.closed:
      return
    try:
      before()
    finally:
      self.closed = True
      try:  # nothing may call back into the loop once it is closed
        self.run(_drain(), 60)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("ckpt: background work still running at close: %s", e)
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(timeout=60)
      if not self._thread.is_alive():
        self._loop.close()


async def _drain() -> None:
  """Cancels what is left on the loop (a lazy read given up, say) and waits
  for it and for the loop's worker threads, so that no TensorStore or
  thread callback reaches the loop after it is closed."""
  tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
  for t in tasks:
    t.cancel()
  await asyncio.gather(*tasks, return_exceptions=True)
  await asyncio.get_running_loop().shutdown_default_executor()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
  """The background thread: at a lower priority, as is every thread it
  starts (ckpt/save/polite.py)."""
  polite.lower_this_thread()
  loop.run_forever()


def _close_at_exit(ref: "weakref.ref[BackgroundLoop]",
                   close: "weakref.WeakMethod") -> None:
  loop, fn = ref(), close()
  if loop is None or fn is None or loop.closed:
    return
  try:
    fn()
  except Exception as e:  # pylint: disable=broad-except
    logging.error("ckpt: the last save did not finish at exit: %s", e)
