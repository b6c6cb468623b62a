"""The save in flight of a Checkpointer: waiting for it, and cancelling it.

``InFlight`` holds how a caller's thread waits for the save running on the
background loop (its commit, then its retention) and re-raises its failure,
and the body of ``Checkpointer.cancel``: the round in which every process
stops its part and process 0 removes the attempt. A mixin of
``ckpt.Checkpointer``: it uses the Checkpointer's fields, made in its
``__init__``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

from absl import logging

from ckpt.commit import steps as steps_lib
from ckpt.commit import cleanup as cleanup_lib
from ckpt.multihost import process as multihost
from ckpt.face import queries
from ckpt.errors import (BarrierTimeoutError, CheckpointError,
                         StoreTimeoutError, WaitTimeoutError)

_UNKNOWN = queries.UNKNOWN  # Checkpointer._newest before a listing


class InFlight:
  """The save in flight of ``ckpt.Checkpointer`` (a mixin; see the module
  docstring)."""

  def _wait_for_save(self, timeout: float | None = None) -> None:
    """Blocks until the in-flight save is committed; re-raises its failure.

    Every thread that waits, waits for the commit (the save stays tracked
    until it is done, whoever waits and however a wait ends, Ctrl-C or a
    ``timeout`` included); each of them sees its failure.
    """
    with self._lock:
      fut, step = self._inflight, self._inflight_step
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
          if self._inflight is fut:
            self._inflight = None

  def _wait_all(self, timeout: float | None) -> None:
    """The body of ``Checkpointer.wait_until_finished``."""
    if timeout is not None and not float(timeout) >= 0:
      raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    self._wait_for_save(timeout)
    self._wait_for_retention(
        None if deadline is None else max(0.0, deadline - time.monotonic()),
        timeout)

  def _settle(self) -> None:
    """Lets the in-flight save end (a restore of the latest step wants its
    commit); its failure stays for the next save or wait."""
    with self._lock:
      fut = self._inflight
    if fut is not None:
      concurrent.futures.wait([fut])

  def _wait_for_retention(self, left: float | None = None,
                          timeout: float | None = None) -> None:
    if self._closed:
      return
    fut = asyncio.run_coroutine_threadsafe(self._retention.wait(), self._loop)
    try:
      fut.result(left)
    except concurrent.futures.TimeoutError:
      if fut.done():
        raise
      raise WaitTimeoutError(
          f"wait_until_finished(timeout={timeout}): the save is committed, "
          f"but retention (deleting the steps the policy drops) was still "
          f"running after {timeout} s; it goes on in the background") from None

  def _cancel(self) -> bool:
    """The body of ``Checkpointer.cancel`` (see its docstring)."""
    key = multihost.call_key(self._key_base, "cancel")
    with self._lock:
      fut, step, attempt = self._inflight, self._inflight_step, self._attempt
    mine = {"step": None, "waiting": None}
    if not self._closed and fut is not None and not fut.done():
      mine["step"] = step
      try:
        asyncio.run_coroutine_threadsafe(self._cancel_task(),
                                         self._loop).result()
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("ckpt: cancel(): stopping the save of step %s: %s",
                        step, e)
      if attempt is not None and attempt.waiting:
        mine["waiting"] = attempt.waiting[0]

    def decide(posts: dict[int, str]) -> str:
      got = {p: json.loads(v) for p, v in posts.items()}
      steps = sorted({g["step"] for g in got.values()
                      if g["step"] is not None})
      # At most one barrier has waiting threads (a process past a barrier
      # means every process arrived there): the others arrive there too.
      waiting = sorted({g["waiting"] for g in got.values() if g["waiting"]})
      out = {"cancelled": False, "why": "", "release": waiting[:1],
             "waiting": [p for p, g in got.items() if g["waiting"]]}
      if not steps:
        return json.dumps(out)
      try:
        if (attempt is None or attempt.step != steps[-1] or
            steps_lib.is_committed(self.storage, attempt.step)):
          out["why"] = f"step {steps[-1]} committed meanwhile"
          return json.dumps(out)
        out["cancelled"] = True
        cleanup_lib.remove_attempt(self.storage, attempt.step, attempt.token)
      except Exception as e:  # pylint: disable=broad-except
        out["why"] = (
            f"the attempt {attempt.token} of step {attempt.step} in "
            f"{self.storage.url!r} could not be removed ({e}); the next "
            "save's cleanup removes it once its lease is "
            f"{self.lease_s:g} s old")[:1000]
      return json.dumps(out)

    decision = json.loads(multihost.agree(
        key, json.dumps(mine), decide, timeout_s=self.barrier_timeout_s,
        what="cancel(): every process stopped its save"))
    pid = multihost.process_index()
    for name in decision["release"]:
      if pid not in decision["waiting"]:
        # Releases the threads of the processes that were cancelled while
        # waiting there (their result is dropped).
        try:
          multihost.barrier(name, timeout_s=self.barrier_timeout_s,
                            what="cancel(): releasing the cancelled save's "
                            "barrier")
        except CheckpointError as e:
          logging.warning("ckpt: cancel(): %s", e)
    with self._lock:
      if mine["step"] is not None and self._inflight is fut:
        self._inflight = None  # its failure is the cancel, not raised
      self._newest = self._after_commit = _UNKNOWN
    if decision["why"]:
      logging.warning("ckpt: cancel(): %s", decision["why"])
    if decision["cancelled"]:
      self._last_saved = _UNKNOWN  # the step was not saved
      logging.info("ckpt: cancelled the save of step %s in %s", step,
                   self.storage.url)
    return bool(decision["cancelled"])

  async def _cancel_task(self) -> None:
    """On the loop: cancels the save's task and waits until it ended
    (its TensorStore requests end first, ckpt/store/tsfuture.py)."""
    task = self._task
    if task is None or task.done():
      return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
