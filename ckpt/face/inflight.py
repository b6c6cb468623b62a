"""The save in flight of a Checkpointer: registering it, waiting for it, cancelling it.

``InFlightSave`` owns the one save running on the background loop: its
future, its step, its attempt and its task, under one lock. A caller's thread
waits for it (its commit) and gets its failure; ``cancel`` is the body of
``Checkpointer.cancel``: the round in which every process stops its part and
process 0 removes the attempt. Nothing else reads these fields.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Callable

from absl import logging

from ckpt.commit import cleanup as cleanup_lib
from ckpt.commit import steps as steps_lib
from ckpt.face import loop as loop_lib
from ckpt.face import rounds as rounds_lib
from ckpt.multihost import process as multihost
from ckpt.save import outcome
from ckpt.store import storage as storage_lib
from ckpt.errors import (BarrierTimeoutError, CheckpointError,
                         StoreTimeoutError, WaitTimeoutError)


class InFlightSave:
  """At most one save in flight, and how the caller's threads wait for it."""

  def __init__(self):
    self._lock = threading.Lock()
    self._future: concurrent.futures.Future | None = None
    self._step: int | None = None
    self._attempt: outcome.Attempt | None = None  # cancel() removes it
    self._task: asyncio.Task | None = None  # what cancel() cancels

  def start(self, future: concurrent.futures.Future, step: int,
            attempt: outcome.Attempt) -> None:
    """``future`` (the save of ``step`` on the loop) is the save in flight."""
    with self._lock:
      self._future, self._step, self._attempt = future, step, attempt

  def running_as(self, task: asyncio.Task | None) -> None:
    """On the loop: the save's task (what ``cancel`` cancels)."""
    self._task = task

  def running(self) -> bool:
    """True while the save is not yet done (committed, failed)."""
    with self._lock:
      fut = self._future
    return fut is not None and not fut.done()

  def step_running(self) -> int | None:
    """The step of the save in flight, None when none runs."""
    with self._lock:
      fut, step = self._future, self._step
    return step if fut is not None and not fut.done() else None

  def if_idle(self, fn: Callable[[], None]) -> bool:
    """Calls ``fn`` (under the lock: no save starts meanwhile) when no
    save runs; whether it did."""
    with self._lock:
      if self._future is None or self._future.done():
        fn()
        return True
    return False

  def waiting(self) -> list[str]:
    """The barrier or the outcome key the save's threads wait at (its
    attempt's)."""
    with self._lock:
      attempt = self._attempt
    return [] if attempt is None else attempt.waiting.at()

  def check(self) -> None:
    """Raises the save's failure now if it is done; never waits."""
    with self._lock:
      fut = self._future
    if fut is not None and fut.done():
      self.wait()

  def settle(self) -> None:
    """Lets the save end (a restore of the latest step wants its commit);
    its failure stays for the next save or wait."""
    with self._lock:
      fut = self._future
    if fut is not None:
      concurrent.futures.wait([fut])

  def wait(self, timeout: float | None = None) -> None:
    """Blocks until the save is committed; re-raises its failure.

    Every thread that waits, waits for the commit (the save stays tracked
    until it is done, whoever waits and however a wait ends, Ctrl-C or a
    ``timeout`` included); each of them sees its failure.
    """
    with self._lock:
      fut, step = self._future, self._step
    if fut is None:
      return
    try:
      try:
        fut.result(timeout)
      except concurrent.futures.TimeoutError:
        if fut.done():
          raise  # the save itself raised a TimeoutError: its failure
        raise WaitTimeoutError(
            f"wait_until_finished(timeout={timeout}): the save of step "
            f"{step} was not committed after {timeout} s on process "
            f"{multihost.process_index()}; it goes on in the background and "
            "stays tracked (wait again, or the next save or close waits for "
            "it)") from None
    except WaitTimeoutError:
      raise
    except CheckpointError as e:
      if f"step {step}" in str(e):
        raise  # it names the step already (barrier timeouts do)
      # A timeout stays one (a coordination service that did not answer).
      kind = (type(e) if isinstance(e, (BarrierTimeoutError, StoreTimeoutError))
              else CheckpointError)
      raise kind(
          f"saving step {step} failed on process "
          f"{multihost.process_index()}: {e}") from e
    except Exception as e:
      raise CheckpointError(
          f"saving step {step} failed on process "
          f"{multihost.process_index()}: {type(e).__name__}: {e}") from e
    finally:
      if fut.done():
        with self._lock:
          if self._future is fut:
            self._future = None

  # ---- cancel -----------------------------------------------------------

  def cancel(self, loop: loop_lib.BackgroundLoop, rounds: rounds_lib.Rounds,
             storage: storage_lib.Storage, lease_s: float) -> bool:
    """The body of ``Checkpointer.cancel`` (see its docstring): True if
    the save was cancelled on every process."""
    key = rounds.key("cancel")
    with self._lock:
      fut, step, attempt = self._future, self._step, self._attempt
    mine = {"step": None, "waiting": None}
    if not loop.closed and fut is not None and not fut.done():
      mine["step"] = step
      try:
        loop.run(self._cancel_task())
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("ckpt: cancel(): stopping the save of step %s: %s",
                        step, e)
      if attempt is not None:  # its thread enters no barrier from now on
        mine["waiting"] = attempt.waiting.close()

    def decide(got: dict[int, dict]) -> dict:
      steps = sorted({g["step"] for g in got.values()
                      if g["step"] is not None})
      # At most one barrier has waiting threads (a process past a barrier
      # means every process arrived there): the others arrive there too.
      waiting = sorted({g["waiting"] for g in got.values() if g["waiting"]})
      out = {"cancelled": False, "why": "", "release": waiting[:1],
             "waiting": [p for p, g in got.items() if g["waiting"]]}
      if not steps:
        return out
      try:
        if (attempt is None or attempt.step != steps[-1] or
            steps_lib.is_committed(storage, attempt.step)):
          out["why"] = f"step {steps[-1]} committed meanwhile"
          return out
        out["cancelled"] = True
        cleanup_lib.remove_attempt(storage, attempt.step, attempt.token)
      except Exception as e:  # pylint: disable=broad-except
        out["why"] = (
            f"the attempt {attempt.token} of step {attempt.step} in "
            f"{storage.url!r} could not be removed ({e}); the next "
            f"save's cleanup removes it once its lease is {lease_s:g} s "
            "old")[:1000]
      return out

    decision = rounds.agree(key, mine, decide,
                            "cancel(): every process stopped its save")
    pid = multihost.process_index()
    for name in decision["release"]:
      if pid not in decision["waiting"]:
        # Releases the threads of the processes that were cancelled while
        # waiting there (their result is dropped): a barrier by arriving,
        # the wait for the outcome (ckpt/save/outcome.py) by process 0 setting it.
        try:
          if not name.endswith(outcome.OUTCOME):
            multihost.barrier(name, timeout_s=rounds.barrier_s,
                              what="cancel(): releasing the cancelled save's "
                              "barrier")
          elif pid == 0:
            multihost.announce_value(name, '{"cancelled": true}',
                                     rounds.barrier_s)
        except CheckpointError as e:
          logging.warning("ckpt: cancel(): %s", e)
    with self._lock:
      if mine["step"] is not None and self._future is fut:
        self._future = None  # its failure is the cancel, not raised
    if decision["why"]:
      logging.warning("ckpt: cancel(): %s", decision["why"])
    if decision["cancelled"]:
      logging.info("ckpt: cancelled the save of step %s in %s", step,
                   storage.url)
    return bool(decision["cancelled"])

  async def _cancel_task(self) -> None:
    """On the loop: cancels the save's task and waits until it ended
    (its TensorStore requests end first, ckpt/store/tsfuture.py)."""
    task = self._task
    if task is None or task.done():
      return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
