"""Awaiting TensorStore futures without ever cancelling them.

``await future`` on a TensorStore future (its ``__await__``) cancels the
TensorStore future when the awaiting task is cancelled, and TensorStore's
Python bindings cancel by unregistering the future's completion callback
while holding the GIL. If the operation completes at that moment, that
callback is already running on a TensorStore thread, waiting for the GIL,
and the unregistration waits for the callback: both wait forever, and since
the GIL is never released no signal handler (Ctrl-C, pytest-timeout) runs
either. Seen with tensorstore 0.1.86: 64 reads awaited in tasks cancelled
while they complete froze a process within a few hundred rounds; py-spy
showed the event loop thread in ``PythonFutureObject::Cancel`` ->
``CallbackBase::Unregister`` and TensorStore's workers in
``ExitSafeGilScopedAcquire``. ckpt cancels the reads still running when one
fails (``tasks.gather_or_cancel``), so a failed restore could freeze the job.

``wait`` bridges a TensorStore future into an asyncio future through a done
callback only, so nothing ever cancels the TensorStore one. A caller
cancelled while waiting first lets the operation end (TensorStore bounds it:
its retries), then raises CancelledError: no read or write of a failed
operation is still running (or writing into a caller's buffer) once the
failure is reported.

Inside a bounded operation (ckpt/store/deadline.py: a save, a query, a
restore's reads) neither wait outlasts a stall: once the operation went its
bound without progress ``wait`` abandons the TensorStore future (never
cancels it: the freeze above) and raises the deadline's
``StoreTimeoutError``; a cancelled caller stops waiting for the operation to
end then too. An abandoned operation goes on inside TensorStore until its
retries end; its late result or error is dropped (marked retrieved, so
asyncio logs nothing), and a write keeps its source buffer alive until then,
as a read keeps the array it decodes into (``read_into``: a buffer of the
failed restore, which nothing reads any more). So a store that stops
answering costs a save its bound, not the sum of TensorStore's retries of
every request it makes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import tensorstore as ts

from ckpt.store import deadline as deadline_lib


def _bridge(future: Any) -> asyncio.Future:
  loop = asyncio.get_running_loop()
  out = loop.create_future()

  def settle(done: Any) -> None:  # on the loop's thread
    if out.done():
      return
    try:
      out.set_result(done.result())  # ready: result() does not wait
    except BaseException as e:  # pylint: disable=broad-except
      out.set_exception(e)

  def on_done(done: Any) -> None:  # a TensorStore thread, or inline if ready
    try:
      loop.call_soon_threadsafe(settle, done)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
      pass

  future.add_done_callback(on_done)
  return out


async def wait(future: Any) -> Any:
  """The result of a TensorStore ``Future`` (or of a ``WriteFutures``'
  commit), awaited without linking cancellation to it, and given up once
  the current deadline's operation has gone its bound without progress
  (module docstring); its result is progress."""
  if isinstance(future, ts.WriteFutures):
    future = future.commit
  out = _bridge(future)
  deadline = deadline_lib.current()
  try:
    if deadline is None:
      return await asyncio.shield(out)
    # asyncio.wait never cancels what it waits for.
    while not out.done():
      left = deadline.left()
      if left <= 0:
        out.add_done_callback(_drop_error)  # abandoned: see _drop_error
        deadline.abandon(future)
        raise deadline.error()
      await asyncio.wait([out], timeout=deadline.slice(left))
    got = out.result()
    deadline.progress()
    return got
  except asyncio.CancelledError:
    # Its error, if any, belongs to nobody now: marked as retrieved, so
    # asyncio does not log "exception was never retrieved" for it.
    out.add_done_callback(_drop_error)
    # The operation ends on its own (or is abandoned once it stalls).
    while not out.done() and (deadline is None or deadline.left() > 0):
      await asyncio.wait([out], timeout=None if deadline is None
                         else deadline.slice(deadline.left()))
    if not out.done():
      deadline.abandon(future)
    raise


def _drop_error(out: asyncio.Future) -> None:
  if not out.cancelled():
    out.exception()
