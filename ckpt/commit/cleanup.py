"""Cleanup of abandoned attempts and unfinished deletions.

What process 0 may delete at every save (ckpt/commit/protocol.py says why it
is safe): ``abandoned`` names the attempts whose holder is provably dead or
whose lease expired (ckpt/commit/lease.py) and the half-done deletions;
``remove`` removes one such name, re-reading what it removes so that a step
committed meanwhile is never touched; ``remove_attempt`` removes one known
attempt (a cancelled save); ``OwnFailures`` keeps a Checkpointer's own failed
attempts until its next save removes them.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from absl import logging

from ckpt.commit import attempt
from ckpt.commit import lease as lease_lib
from ckpt.commit import steps as steps_lib
from ckpt.commit import strategy
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError
from ckpt.store import names as names_lib


# An attempt directory that holds nothing, not even its lease, is a save
# that died between creating it and writing its lease (microseconds on a
# live one): once it is this old, nobody can be about to write its lease.
UNFINISHED_PREPARE_S = 2.0
# How often OwnFailures.sweep looks whether the save it runs beside ended.
POLL_S = 0.1
# How long after a failed save a request of it may still land: TensorStore's
# retries of one request with ckpt's STORE_RETRIES (1+2+4+8+4*16 s of
# backoff, up to 1 s of jitter each) and the request itself.
QUIET_S = 120.0


def _live(storage: storage_lib.Storage, rel: str, lease_s: float,
          reasons: dict | None = None, clock=None) -> bool | None:
  """Whether the attempt at ``rel`` may still be saving: False when its
  holder is provably dead, its lease is older than ``lease_s`` (dated by
  ``clock``: see ckpt/commit/lease.py; ``lease_s`` 0: every attempt), or
  (POSIX) it is an empty directory that never got its lease and is older
  than ``UNFINISHED_PREPARE_S`` (the reason goes into ``reasons[rel]``);
  None when its age is unknown."""
  kind = strategy.for_storage(storage)
  data, gen = kind.read_lease(f"{rel}/{attempt.ATTEMPT_FILE}")
  lease = lease_lib.parse(data)
  dead = None if lease is None else lease_lib.dead_reason(lease)
  if dead is None and lease_s <= 0:
    dead = "every uncommitted attempt counts (lease_s=0)"
  if dead is None:
    clock = kind.clock(None) if clock is None else clock
    age = clock.age_s(rel, None if data is None else gen)
    if age is None:
      return None
    if (lease is None and age >= UNFINISHED_PREPARE_S
        and kind.holds_nothing(rel)):
      dead = (f"it holds nothing, not even its lease, and is {age:.0f} s old "
              "(a save that died as it created it)")
    elif age < lease_s:
      return True
    else:
      dead = f"{kind.stale_lease.format(age=age)} (lease_s={lease_s:g})"
  if reasons is not None:
    reasons[rel] = dead
  return False


def is_live(storage: storage_lib.Storage, rel: str, lease_s: float,
            seen: lease_lib.Sightings | None = None) -> bool | None:
  """``_live`` for one attempt, with this cleaner's sightings ``seen``."""
  return _live(storage, rel, lease_s, None,
               strategy.for_storage(storage).clock(seen))


def abandoned(storage: storage_lib.Storage,
              lease_s: float = lease_lib.DEFAULT_LEASE_S,
              reasons: dict | None = None,
              seen: lease_lib.Sightings | None = None) -> list[str]:
  """Relative directories of attempts that are provably abandoned (and, on
  object stores, steps whose deletion died half way); ``reasons`` gets why,
  for attempts (see ``_live``). ``seen``: what this cleaner saw of the
  leases before (object stores: a lease first seen now is not old).

  POSIX: one listing of the root. Object stores: one listing of
  ``pending/`` and a read or two per entry (the lease of an attempt, the
  record of a step); a root not migrated yet is also listed in full, as
  earlier versions did."""
  kind = strategy.for_storage(storage)
  clock = kind.clock(seen)
  out = kind.abandoned(lambda rel: _live(storage, rel, lease_s, reasons,
                                         clock))
  clock.forget_unseen()
  return out


# ---- deletion ---------------------------------------------------------------

def remove(storage: storage_lib.Storage, rel: str) -> None:
  """Deletes a step, an attempt or a leftover directory; a committed step
  stops being visible first, so it is never seen half-deleted. On object
  stores ``pending/<step>.delete`` (a name ``abandoned`` gives) finishes
  that deletion."""
  kind = strategy.for_storage(storage)
  if kind.finish_deletion(rel):
    return
  if not names_lib.is_deletable(rel):
    raise CheckpointError(
        f"refusing to delete {rel!r} in {storage.url!r}: ckpt deletes only "
        "checkpoint_<step>, checkpoint_<step>.tmp-<id> and "
        "checkpoint_<step>/attempt-<id> directories")
  step = names_lib.parse_step(rel)
  what = f"step {step}" if step is not None else repr(rel)
  kind.remove(rel, step, what)


def remove_abandoned(storage: storage_lib.Storage, name: str) -> None:
  """Removes one entry of ``abandoned`` as it is now, never more than what
  was found abandoned (between that check and this call another job may
  have committed the same step). Object stores: ``pending/<step>.delete``
  finishes what that deletion names; a whole step (found by a full listing
  of a root without records) is only the keys an earlier ckpt left beside
  no marker. Everything else as ``remove``."""
  step = names_lib.parse_step(name)
  if (step is not None
      and strategy.for_storage(storage).remove_leftovers(step)):
    return
  remove(storage, name)


def remove_attempt(storage: storage_lib.Storage, step: int, token: str) -> None:
  """Deletes one attempt that did not commit (never a committed step)."""
  remove(storage, steps_lib.work_dir(storage, step, token))


class OwnFailures:
  """The attempts of one Checkpointer's saves that failed (process 0),
  removed by its next saves (``sweep``) whatever their lease says: their
  holder, this Checkpointer, knows they are dead. Before, a failed save
  whose removal failed too (the store was down) left its attempt to the
  lease rule, which a live holder's fresh lease keeps for ``lease_s``
  (and a lease first seen then is not old); and a removal that succeeded
  could be followed by a late write of the failed save.

  Late writes: a TensorStore write of many chunks fails at its first
  failed chunk while the requests of the others go on inside TensorStore
  (their retries), and a write the deadline abandoned goes on too. Seen
  on moto: one chunk of the failed save landed after the store came back,
  after the failed attempt was removed, and stayed. So an attempt is
  removed at the start of the next save and again at its end, and by
  every later save until it is quiet: ``QUIET_S`` after the failure (the
  longest TensorStore retries a request with ckpt's ``STORE_RETRIES``)
  and once ``settled()`` (the requests the deadline abandoned, if any,
  have all ended). Thread-safe."""

  def __init__(self):
    self._lock = threading.Lock()
    self._attempts: dict[tuple[int, str], tuple[float, Callable]] = {}

  def failed(self, step: int, token: str,
             settled: Callable[[], bool] = lambda: True) -> None:
    with self._lock:
      self._attempts[step, token] = (time.monotonic() + QUIET_S, settled)

  def sweep(self, storage: storage_lib.Storage) -> list[str]:
    """Removes every failed attempt now; forgets each one removed that was
    quiet. Returns the relative directories it removed."""
    return self._pass(storage)

  def sweep_after(self, storage: storage_lib.Storage,
                  running: Callable[[], bool]) -> list[str]:
    """``sweep`` again once ``running()`` is False (the save it runs
    beside ended), if any attempt is left: the late writes that landed
    meanwhile."""
    with self._lock:
      if not self._attempts:
        return []
    while running():
      time.sleep(POLL_S)
    return self._pass(storage)

  def _pass(self, storage: storage_lib.Storage) -> list[str]:
    with self._lock:
      attempts = dict(self._attempts)
    removed = []
    for (step, token), (quiet_at, settled) in attempts.items():
      quiet = time.monotonic() >= quiet_at and settled()  # before removing
      try:
        remove_attempt(storage, step, token)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("ckpt: could not remove the failed attempt %s of "
                        "step %d in %s (again at the next save): %s", token,
                        step, storage.url, e)
        continue
      removed.append(steps_lib.work_dir(storage, step, token))
      if quiet:
        with self._lock:
          if self._attempts.get((step, token)) == (quiet_at, settled):
            del self._attempts[step, token]
    return removed
