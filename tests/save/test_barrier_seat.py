"""``Checkpointer.cancel`` releases a cancelled save's thread from the barrier
it waits at by having the other processes arrive there; it must know
whether the thread is really in it (ckpt/save/seat.py). A barrier call
still queued in the loop's executor when the save is cancelled never runs:
reporting it as "waiting" made the other process wait at that barrier alone
for barrier_timeout_s and miss the next round (a flake of
tests/tiers/test_mesh_context.py, reproduced 1 run in ~30 under load)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from ckpt.errors import CheckpointError
from ckpt.save import outcome
from ckpt.save import seat as seat_lib


def _attempt() -> outcome.Attempt:
  return outcome.Attempt(step=2, key="ckpt/test/save/2/0", token="t",
                        work_dir="w", timeout_s=5.0)


def test_a_barrier_call_still_queued_when_cancelled_is_not_waiting():
  """The executor's one worker is busy: the save's barrier call is queued
  when its task is cancelled; the seat says no thread is in a barrier, and
  the call never runs."""
  attempt = _attempt()
  busy, release = threading.Event(), threading.Event()
  executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
  loop = asyncio.new_event_loop()
  loop.set_default_executor(executor)
  try:
    executor.submit(lambda: (busy.set(), release.wait(30)))
    assert busy.wait(30)

    async def scenario():
      task = asyncio.ensure_future(outcome.barrier(
          attempt, "written", outcome.WRITTEN))
      for _ in range(5):  # the task runs up to its await (the queued call)
        await asyncio.sleep(0)
      assert not task.done()
      task.cancel()
      await asyncio.gather(task, return_exceptions=True)
      return task.cancelled()
    assert loop.run_until_complete(scenario())
    # Cancel's view, taken after the task ended (inflight.py): no thread
    # is in a barrier, so no other process is sent to release one.
    assert attempt.waiting.close() is None
    release.set()
    executor.shutdown(wait=True)  # the queued call was dropped, not run
    assert attempt.waiting.at() == []
  finally:
    release.set()
    loop.close()


def test_a_thread_in_the_barrier_is_waiting_until_it_returns():
  seat = seat_lib.BarrierSeat()
  entered, release = threading.Event(), threading.Event()

  def barrier():
    entered.set()
    assert release.wait(30)

  t = threading.Thread(target=seat.wait, args=("k/written", barrier))
  t.start()
  assert entered.wait(30)
  assert seat.at() == ["k/written"]
  # The save is cancelled while its thread is in the barrier: cancel
  # learns which barrier to release.
  assert seat.close() == "k/written"
  release.set()  # the other processes arrived
  t.join(30)
  assert not t.is_alive()
  assert seat.at() == []


def test_a_closed_seat_enters_no_barrier():
  """The thread reaches its barrier only after cancel closed the seat: it
  raises without calling it (nobody would release it)."""
  seat = seat_lib.BarrierSeat()
  assert seat.close() is None
  called = []
  with pytest.raises(CheckpointError, match="cancelled"):
    seat.wait("k/done", lambda: called.append(1))
  assert called == [] and seat.at() == []
