"""Process 0's renewal of its attempt's lease while the save runs.

The lease (``attempt.json``, ckpt/commit/lease.py) is renewed every
``lease.renew_interval(lease_s)`` seconds (from the start of one to the
start of the next) by a thread of its own, through a kvstore of its own:
its own TensorStore context, with its own retries and a request queue of
its own (``Storage.context(own_queue=True)``: a context that names none
shares TensorStore's default queue with every other one of the process),
so a renewal never waits in the save's queue of uploads nor for the save's
event loop. Through a store throttled to 1 MiB/s with 128 uploads queued
(tests/objectstore/test_lease_bucket.py) the largest gap between two
renewals went from 12.4 s to 2.2-3.3 s (lease_s 12 s). Its requests are no
progress of the save (ckpt/store/traffic.py: each is announced aside).
How one renewal writes is the storage kind's (``FileLease`` in
ckpt/commit/rename.py, ``ObjectLease`` in marker.py).

A renewal never recreates what was removed:

- object stores: each renewal is a write conditional on the generation of
  the lease the previous one wrote (the first: the one read at start). A
  condition that fails is read again: a lease holding this attempt's token
  and a renewal number this holder wrote is its own (a retried request
  that landed twice); anything else (missing: a cleaner removed the
  attempt) means the attempt is lost, and the renewals stop;
- POSIX: a renewal writes a new file and renames it into the attempt's
  directory only while that directory and its lease are there (a cleaner
  renames the directory away first, so the write fails).

``commit`` (ckpt/commit/protocol.py) asks ``final()`` for the last word: the
renewals stop, one more conditional renewal proves the lease is still this
attempt's, and its generation is what the commit checks again once the
step's record is written. A lost lease fails the save with a
CheckpointError saying its work was removed.
"""

from __future__ import annotations

import threading
import time

from absl import logging

from ckpt.commit import attempt
from ckpt.commit import lease as lease_lib
from ckpt.commit import strategy
from ckpt.errors import CheckpointError
from ckpt.store import storage as storage_lib


class Renewal:
  """The lease of one attempt, renewed until ``stop`` or ``final``."""

  def __init__(self, storage: storage_lib.Storage, step: int, token: str,
               lease_s: float):
    self.storage = storage
    self.step, self.token = step, token
    kind = strategy.for_storage(storage)
    self.rel = kind.work_dir(step, token)
    self.key = f"{self.rel}/{attempt.ATTEMPT_FILE}"
    self.where = f"{storage.url.rstrip('/')}/{self.rel}"
    self.interval_s = lease_lib.renew_interval(lease_s, kind.least_renewal_s)
    self._least_s = kind.least_renewal_s
    self.request_s = max(lease_s, 10.0)  # one renewal's bound
    self.lost: str | None = None
    self.renewed_at: list[float] = []  # time.monotonic() of each renewal
    self._count = 0
    self._lease = kind.lease(self.key, token, self.request_s)
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  # ---- life -----------------------------------------------------------

  def start(self) -> "Renewal":
    self._thread = threading.Thread(
        target=self._run, daemon=True,
        name=f"ckpt-lease-{self.step}-{self.token[:8]}")
    self._thread.start()
    return self

  def stop(self) -> None:
    """No renewal starts after this (one in flight ends on its own)."""
    self._stop.set()

  def take(self) -> "Renewal":
    """Renews once now, before ``start``: the lease then names this
    process as its holder (a writer process taking over the attempt
    process 0's trainer prepared: ckpt/commit/through_storage.py). Raises
    the removed_error if the lease is lost."""
    with self._lock:
      if self.lost is None:
        self._renew()
      if self.lost is not None:
        raise attempt.removed_error(self.step, self.where, self.lost)
    return self

  def final(self) -> bytes | None:
    """Stops the renewals and renews once more: the lease's generation
    now (None on POSIX); raises the removed_error if the lease is lost."""
    self.stop()
    with self._lock:
      if self.lost is None:
        try:
          self._renew()
        except Exception as e:  # pylint: disable=broad-except
          raise CheckpointError(
              f"cannot commit step {self.step}: renewing its lease "
              f"{self.where}/{attempt.ATTEMPT_FILE} before the commit "
              f"failed: {type(e).__name__}: {e}") from e
      if self.lost is not None:
        raise attempt.removed_error(self.step, self.where, self.lost)
      return self._lease.generation

  def _run(self) -> None:
    # Every interval_s from the start of the previous renewal, not from its
    # end: a renewal that crawls through a saturated link (its requests wait
    # for the pieces of the uploads ahead of them on the wire) does not
    # stretch the period; but never sooner than the medium's least time
    # after the previous one ended.
    due = time.monotonic() + self.interval_s
    with self._lock:  # the lease's generation now, not when it is due
      try:
        if not self._stop.is_set():
          self.lost = self._lease.prime()
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("ckpt: reading the lease of step %d (%s) failed "
                        "(again at its first renewal): %s", self.step,
                        self.where, e)
    while self.lost is None and not self._stop.wait(
        max(0.0, due - time.monotonic())):
      start = time.monotonic()
      with self._lock:
        if self._stop.is_set() or self.lost is not None:
          return
        try:
          self._renew()
        except Exception as e:  # pylint: disable=broad-except
          logging.warning("ckpt: renewing the lease of step %d (%s) failed: "
                          "%s", self.step, self.where, e)
      due = max(start + self.interval_s, time.monotonic() + self._least_s)
      if self.lost is not None:
        logging.error("ckpt: the attempt %s of step %d was removed while "
                      "saving (%s); this save will fail at its commit",
                      self.where, self.step, self.lost)
        return

  # ---- one renewal (under the lock) -----------------------------------

  def _renew(self) -> None:
    self._count += 1
    lost = self._lease.renew(lease_lib.make(self.token, self._count),
                             self._count)
    if lost is not None:
      self.lost = lost
    else:
      self.renewed_at.append(time.monotonic())
