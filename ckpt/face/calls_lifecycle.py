"""The background loop of a Checkpointer: starting it, running on it, closing it.

``Lifecycle`` starts the one asyncio event loop a Checkpointer owns, on its
background thread (at a lower priority, ckpt/save/polite.py), registers the
close that a job ending without ``close()`` still gets (so that its last save
commits), runs coroutines on the loop for the caller's thread, and holds the
body of ``Checkpointer.close``: wait, then cancel what is left on the loop and
stop it. A mixin of ``ckpt.Checkpointer``.

A ``close`` racing a ``save`` on another thread: a save that has passed its
entry (``_enter_save``) is waited for by close, to its commit or its
failure, like a save in flight; a save that enters once close has begun is
refused at once ("closed"), before anything is written. So the loop never
stops under a save that still needs it (before, such a save made its
attempt and then found the loop gone: it hung, or failed leaving the
attempt behind).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
import weakref

from absl import logging

from ckpt.save import polite
from ckpt.errors import CheckpointError


class Lifecycle:
  """The background loop of ``ckpt.Checkpointer`` (a mixin; see the module
  docstring)."""

  def _start_loop(self) -> None:
    """The end of ``Checkpointer.__init__``: the background loop and thread,
    and the close at exit."""
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=_run_loop, args=(self._loop,),
                                    name="ckpt-background", daemon=True)
    self._thread.start()
    self._closed = False
    # close() racing save(): the saves between their entry and their
    # registration in flight (thread ident -> count), and whether close
    # has begun (then no save enters).
    self._entry = threading.Condition()
    self._entered: dict[int, int] = {}
    self._closing = False
    self._closed_event = threading.Event()
    # A job that ends without close() still finishes (commits) its last save.
    # It must run before the interpreter stops thread pools (asyncio.to_thread
    # refuses work after that), which plain atexit handlers do not.
    concurrent.futures.ThreadPoolExecutor  # pylint: disable=pointless-statement
    # (imports the pool module now, so its exit hook is older and runs after)
    getattr(threading, "_register_atexit", atexit.register)(
        _close_at_exit, weakref.ref(self))

  def _close(self) -> None:
    """The body of ``Checkpointer.close`` (see its docstring)."""
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
      self._close_now()
    finally:
      self._closed_event.set()

  def _enter_save(self, step: int) -> None:
    """The entry of ``save``: refused (CheckpointError) once close has
    begun; else close waits for this save until ``_leave_save``."""
    with self._entry:
      if self._closing:
        raise CheckpointError(
            f"save({step}) refused: this Checkpointer is closed, or being "
            "closed by close() on another thread; nothing was written")
      me = threading.get_ident()
      self._entered[me] = self._entered.get(me, 0) + 1

  def _leave_save(self) -> None:
    """The save is in flight (close waits for it as such) or over."""
    with self._entry:
      me = threading.get_ident()
      self._entered[me] -= 1
      if not self._entered[me]:
        del self._entered[me]
      self._entry.notify_all()

  def _close_now(self) -> None:
    if self._closed:
      return
    pending = self._pending_restore
    if pending is not None and not pending.finished:
      pending.cancel("close() was called before its result()")
    try:
      self.wait_until_finished()
    finally:
      self._closed = True
      try:  # nothing may call back into the loop once it is closed
        asyncio.run_coroutine_threadsafe(_drain(), self._loop).result(60)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("ckpt: background work still running at close: %s", e)
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(timeout=60)
      if not self._thread.is_alive():
        self._loop.close()

  def _open_error(self) -> Exception | None:
    """``_check_open``'s error, returned, for a collective call to post in
    its round instead of raising on this process alone."""
    try:
      self._check_open()
    except Exception as e:  # pylint: disable=broad-except
      return e
    return None

  def _check_open(self) -> None:
    if self._closed:
      raise CheckpointError("this Checkpointer is closed")

  def _run(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


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


def _close_at_exit(ref: "weakref.ref[Checkpointer]") -> None:
  ckptr = ref()
  if ckptr is None or ckptr._closed:  # pylint: disable=protected-access
    return
  try:
    ckptr.close()
  except Exception as e:  # pylint: disable=broad-except
    logging.error("ckpt: the last save did not finish at exit: %s", e)
