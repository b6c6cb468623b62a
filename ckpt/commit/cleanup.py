"""Cleanup of abandoned attempts and unfinished deletions.

What process 0 may delete at every save (ckpt/commit/protocol.py says why it
is safe): ``abandoned`` names the attempts whose holder is provably dead or
whose lease expired (ckpt/commit/lease.py) and the half-done deletions;
``remove`` removes one such name, re-reading what it removes so that a step
committed meanwhile is never touched; ``remove_attempt`` removes one known
attempt (a cancelled save).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil

from ckpt.commit import deletion
from ckpt.commit import lease as lease_lib
from ckpt.commit import records
from ckpt.commit import steps as steps_lib
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError
from ckpt.store import names as names_lib


_DEL_RE = re.compile(r"^checkpoint_\d+\.tmp-del-[0-9a-f]+$")


def store_now(storage: storage_lib.Storage) -> float | None:
  """POSIX: now on the file system's clock (ckpt/commit/lease.py): the
  modification time of a probe file created in the root, then removed;
  None if none can be made there (nothing is then old enough)."""
  probe = os.path.join(os.fspath(storage.root),
                       f".ckpt-clock-{secrets.token_hex(4)}")
  try:
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
  except OSError:
    return None
  try:
    return os.fstat(fd).st_mtime
  finally:
    os.close(fd)
    try:
      os.unlink(probe)
    except OSError:
      pass


def _mtime(path) -> float | None:
  try:
    return os.stat(path).st_mtime
  except OSError:
    return None


class _Clock:
  """How one cleanup pass dates leases (ckpt/commit/lease.py): on POSIX
  against the file system's clock, read once (lazily) per pass; on object
  stores by the cleaner's ``Sightings`` of their generations."""

  def __init__(self, storage: storage_lib.Storage,
               seen: lease_lib.Sightings | None):
    self.storage = storage
    self.seen = lease_lib.Sightings() if seen is None else seen
    self.dated: list[str] = []  # the attempts dated by ``seen``
    self._now: list = []

  def age_s(self, rel: str, generation: bytes | None) -> float | None:
    """Seconds since the attempt at ``rel`` last changed (None: unknown);
    ``generation``: its lease's (object stores; None: no lease)."""
    if self.storage.is_posix:
      root = self.storage.root
      t = _mtime(root / rel / steps_lib.ATTEMPT_FILE)
      if t is None:
        t = _mtime(root / rel)
      if t is None:
        return None
      if not self._now:
        self._now.append(store_now(self.storage))
      return None if self._now[0] is None else self._now[0] - t
    if generation is None:
      # No attempt.json (yet, or any more): its pending record's.
      s, _, tail = rel.partition("/")
      m = records.ATTEMPT_DIR_RE.match(tail)
      step = names_lib.parse_step(s)
      if not m or step is None:
        return None
      data, generation = self.storage.read_generation(
          records.pending_key(step, m.group(1)))
      if data is None:
        return None
    self.dated.append(rel)
    return self.seen.unchanged_for(rel, generation)


# An attempt directory that holds nothing, not even its lease, is a save
# that died between creating it and writing its lease (microseconds on a
# live one): once it is this old, nobody can be about to write its lease.
UNFINISHED_PREPARE_S = 2.0


def _live(storage: storage_lib.Storage, rel: str, lease_s: float,
          reasons: dict | None = None, clock: _Clock | None = None
          ) -> bool | None:
  """Whether the attempt at ``rel`` may still be saving: False when its
  holder is provably dead, its lease is older than ``lease_s`` (dated by
  ``clock``: see ckpt/commit/lease.py; ``lease_s`` 0: every attempt), or
  (POSIX) it is an empty directory that never got its lease and is older
  than ``UNFINISHED_PREPARE_S`` (the reason goes into ``reasons[rel]``);
  None when its age is unknown."""
  key = f"{rel}/{steps_lib.ATTEMPT_FILE}"
  if storage.is_posix:
    data, gen = storage.read_bytes(key), None
  else:
    data, gen = storage.read_generation(key)
  lease = lease_lib.parse(data)
  dead = None if lease is None else lease_lib.dead_reason(lease)
  if dead is None and lease_s <= 0:
    dead = "every uncommitted attempt counts (lease_s=0)"
  if dead is None:
    clock = _Clock(storage, None) if clock is None else clock
    age = clock.age_s(rel, None if data is None else gen)
    if age is None:
      return None
    what = ("unchanged for" if not storage.is_posix
            else "last written")
    if lease is None and age >= UNFINISHED_PREPARE_S and _empty(storage, rel):
      dead = (f"it holds nothing, not even its lease, and is {age:.0f} s old "
              "(a save that died as it created it)")
    elif age < lease_s:
      return True
    else:
      dead = (f"its lease was {what} {age:.0f} s "
              f"{'ago ' if storage.is_posix else ''}(lease_s={lease_s:g})")
  if reasons is not None:
    reasons[rel] = dead
  return False


def is_live(storage: storage_lib.Storage, rel: str, lease_s: float,
            seen: lease_lib.Sightings | None = None) -> bool | None:
  """``_live`` for one attempt, with this cleaner's sightings ``seen``."""
  return _live(storage, rel, lease_s, None, _Clock(storage, seen))


def _empty(storage: storage_lib.Storage, rel: str) -> bool:
  """POSIX: the attempt directory holds at most a lease being written."""
  if not storage.is_posix:
    return False
  try:
    names = os.listdir(storage.root / rel)
  except OSError:
    return False
  return all(n.startswith(f"{steps_lib.ATTEMPT_FILE}.partial-") for n in names)


def abandoned(storage: storage_lib.Storage,
              lease_s: float = lease_lib.DEFAULT_LEASE_S,
              reasons: dict | None = None,
              seen: lease_lib.Sightings | None = None) -> list[str]:
  """Relative directories of attempts that are provably abandoned (and, on
  object stores, steps whose deletion died half way); ``reasons`` gets why,
  for attempts (see ``_live``). ``seen``: what this cleaner saw of the
  leases before (object stores: a lease first seen now is not old).

  Object stores: one listing of ``pending/`` and a read or two per entry
  (the lease of an attempt, the record of a step); a root not migrated yet
  is also listed in full, as earlier versions did."""
  out = []
  clock = _Clock(storage, seen)
  if storage.is_posix:
    if not storage.root.exists():
      return []
    for p in sorted(storage.root.iterdir()):
      if _DEL_RE.match(p.name):
        out.append(p.name)
      elif names_lib.is_tmp_name(p.name):
        if _live(storage, p.name, lease_s, reasons, clock) is False:
          out.append(p.name)
    return out
  pending = records.list_pending(storage)
  for s, t in pending:
    if t == records.DELETE:
      continue
    rel = steps_lib.work_dir(storage, s, t)
    if not _live(storage, rel, lease_s, reasons, clock):
      # remove() keeps the data of the attempt that committed s (its
      # pending record alone is left over) and drops a marker naming it
      # that never got its record.
      out.append(rel)
  # Deletions that died, by the name of their pending record: remove()
  # finishes what that record names, as it is when it does (never the
  # step as a whole: see ckpt/commit/deletion.py).
  out += [deletion.name(s) for s, t in pending
          if t == records.DELETE and deletion.unfinished(storage, s)]
  if not records.records_complete(storage):
    out += [r for r in _abandoned_by_scan(storage, lease_s, reasons, clock)
            if r not in out]
  clock.seen.keep_only(clock.dated)  # what is no longer there is forgotten
  return out


def _abandoned_by_scan(storage: storage_lib.Storage, lease_s: float,
                       reasons: dict | None, clock: _Clock) -> list[str]:
  """A root whose records are not complete: from one full listing."""
  out = []
  committed, attempts, loose = steps_lib._scan(storage)
  for s, tokens in sorted(attempts.items()):
    winner = steps_lib.committed_attempt(storage, s) if s in committed else None
    for t in sorted(tokens - {winner}):
      rel = steps_lib.work_dir(storage, s, t)
      # A committed step's losing attempts go once their lease is over too.
      if not _live(storage, rel, lease_s, reasons, clock):
        out.append(rel)
  # Keys of an uncommitted step outside any attempt: a save by ckpt < 0.2
  # that never committed (today's saves write only inside attempts).
  out += [names_lib.step_dirname(s) for s in sorted(loose - committed)
          if s not in attempts]
  return out


# ---- deletion ---------------------------------------------------------------

def remove(storage: storage_lib.Storage, rel: str) -> None:
  """Deletes a step, an attempt or a leftover directory; a committed step
  stops being visible first, so it is never seen half-deleted. On object
  stores ``pending/<step>.delete`` (a name ``abandoned`` gives) finishes
  that deletion."""
  if not storage.is_posix and deletion.parse_name(rel) is not None:
    deletion.finish(storage, deletion.parse_name(rel))
    return
  if not names_lib.is_deletable(rel):
    raise CheckpointError(
        f"refusing to delete {rel!r} in {storage.url!r}: ckpt deletes only "
        "checkpoint_<step>, checkpoint_<step>.tmp-<id> and "
        "checkpoint_<step>/attempt-<id> directories")
  step = names_lib.parse_step(rel)
  what = f"step {step}" if step is not None else repr(rel)
  if storage.is_posix:
    path = storage.root / rel
    with storage.store_errors(f"deleting {what} from"):
      if not path.exists():
        return
      if step is not None:
        steps_lib._drop_bucket_records(storage)
      if not _DEL_RE.match(rel):
        # One atomic rename first: a committed step vanishes at once, and a
        # save still writing into an attempt can no longer commit it.
        head = rel.split(".", 1)[0]
        doomed = storage.root / f"{head}.tmp-del-{secrets.token_hex(4)}"
        os.rename(path, doomed)
        path = doomed
      shutil.rmtree(path, ignore_errors=True)
    return
  if step is not None:  # a whole step: invisible first, then the data
    deletion.remove_step(storage, step)
    return
  head, _, tail = rel.partition("/")
  m = records.ATTEMPT_DIR_RE.match(tail)
  if not m:  # checkpoint_<step>.tmp-<id> (written to a disk, then copied)
    storage.delete_prefix(f"{rel}/", what)
    return
  # One attempt: checkpoint_<step>/attempt-<token>.
  step, token = names_lib.parse_step(head), m.group(1)
  complete = records.records_complete(storage)
  committed, winner = steps_lib._commit_state(storage, step)
  if committed and winner == token:
    # The step itself (a commit that died before removing its pending
    # record, or a legacy root): only that record goes.
    storage.delete_key(records.pending_key(step, token))
    return
  # The lease goes first: a holder committing now checks it after writing
  # its record (ckpt/commit/protocol.py), and the record is read again
  # after this, so one of the two sees the other: either that commit fails
  # (and is undone), or it is seen committed here and its data stays.
  storage.delete_key(f"{rel}/{steps_lib.ATTEMPT_FILE}")
  committed, winner = steps_lib._commit_state(storage, step)
  if committed and winner == token:
    storage.delete_key(records.pending_key(step, token))
    return
  if complete and not committed:
    marker = f"{names_lib.step_dirname(step)}/{names_lib.COMMIT_MARKER}"
    data, gen = storage.read_generation(marker)
    if records.marker_attempt(data) == token:
      # It never got its record: never listed. Only that marker: a commit
      # of another attempt may have replaced it since it was read.
      storage.delete_key(marker, generation=gen)
  storage.delete_prefix(f"{rel}/", what)
  storage.delete_key(records.pending_key(step, token))


def remove_abandoned(storage: storage_lib.Storage, name: str) -> None:
  """Removes one entry of ``abandoned`` as it is now, never more than what
  was found abandoned (between that check and this call another job may
  have committed the same step). Object stores: ``pending/<step>.delete``
  finishes what that deletion names; a whole step (found by a full listing
  of a root without records) is only the keys an earlier ckpt left beside
  no marker. Everything else as ``remove``."""
  step = names_lib.parse_step(name)
  if step is not None and not storage.is_posix:
    deletion.drop_leftovers(storage, step)
    return
  remove(storage, name)


def remove_attempt(storage: storage_lib.Storage, step: int, token: str) -> None:
  """Deletes one attempt that did not commit (never a committed step)."""
  remove(storage, steps_lib.work_dir(storage, step, token))
