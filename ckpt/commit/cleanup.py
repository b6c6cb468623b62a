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
import time

from ckpt.commit import deletion
from ckpt.commit import lease as lease_lib
from ckpt.commit import records
from ckpt.commit import steps as steps_lib
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError

DEFAULT_LEASE_S = lease_lib.DEFAULT_LEASE_S


_DEL_RE = re.compile(r"^checkpoint_\d+\.tmp-del-[0-9a-f]+$")


def _age_s(storage: storage_lib.Storage, rel: str,
           lease: dict | None) -> float | None:
  """Seconds since the attempt's last renewal (None: unknown); ``lease``:
  its ``attempt.json`` as read by ``_live`` (None: missing)."""
  beat = None if lease is None else lease.get("time")
  if type(beat) in (int, float):
    return time.time() - beat
  if storage.is_posix:
    try:
      return time.time() - os.stat(storage.root / rel).st_mtime
    except OSError:
      return None
  # No attempt.json (yet, or any more): the time its pending record was made.
  s, _, tail = rel.partition("/")
  m = records.ATTEMPT_DIR_RE.match(tail)
  step = storage_lib.parse_step(s)
  if m and step is not None:
    t = records.pending_time(storage, step, m.group(1))
    if t is not None:
      return time.time() - t
  return None


# An attempt directory that holds nothing, not even its lease, is a save
# that died between creating it and writing its lease (microseconds on a
# live one): once it is this old, nobody can be about to write its lease.
UNFINISHED_PREPARE_S = 2.0


def _live(storage: storage_lib.Storage, rel: str, lease_s: float,
          reasons: dict | None = None) -> bool | None:
  """Whether the attempt at ``rel`` may still be saving: False when its
  holder is provably dead, its lease is older than ``lease_s``, or (POSIX)
  it is an empty directory that never got its lease and is older than
  ``UNFINISHED_PREPARE_S`` (the reason goes into ``reasons[rel]``); None
  when its age is unknown."""
  lease = lease_lib.parse(storage.read_bytes(f"{rel}/{steps_lib.ATTEMPT_FILE}"))
  dead = None if lease is None else lease_lib.dead_reason(lease)
  if dead is None:
    age = _age_s(storage, rel, lease)
    if age is None:
      return None
    if lease is None and age >= UNFINISHED_PREPARE_S and _empty(storage, rel):
      dead = (f"it holds nothing, not even its lease, and is {age:.0f} s old "
              "(a save that died as it created it)")
    elif age < lease_s:
      return True
    else:
      dead = f"its lease is {age:.0f} s old (lease_s={lease_s:g})"
  if reasons is not None:
    reasons[rel] = dead
  return False


def _empty(storage: storage_lib.Storage, rel: str) -> bool:
  """POSIX: the attempt directory holds at most a lease being written."""
  if not storage.is_posix:
    return False
  try:
    names = os.listdir(storage.root / rel)
  except OSError:
    return False
  return all(n.startswith(f"{steps_lib.ATTEMPT_FILE}.partial-") for n in names)


def abandoned(storage: storage_lib.Storage, lease_s: float = DEFAULT_LEASE_S,
              reasons: dict | None = None) -> list[str]:
  """Relative directories of attempts that are provably abandoned (and, on
  object stores, steps whose deletion died half way); ``reasons`` gets why,
  for attempts (see ``_live``).

  Object stores: one listing of ``pending/`` and a read or two per entry
  (the lease of an attempt, the record of a step); a root not migrated yet
  is also listed in full, as earlier versions did."""
  out = []
  if storage.is_posix:
    if not storage.root.exists():
      return []
    for p in sorted(storage.root.iterdir()):
      if _DEL_RE.match(p.name):
        out.append(p.name)
      elif storage_lib.is_tmp_name(p.name):
        if _live(storage, p.name, lease_s, reasons) is False:
          out.append(p.name)
    return out
  pending = records.list_pending(storage)
  for s, t in pending:
    if t == records.DELETE:
      continue
    rel = steps_lib.work_dir(storage, s, t)
    if not _live(storage, rel, lease_s, reasons):
      # remove() keeps the data of the attempt that committed s (its
      # pending record alone is left over) and drops a marker naming it
      # that never got its record.
      out.append(rel)
  # Deletions that died, by the name of their pending record: remove()
  # finishes what that record names, as it is when it does (never the
  # step as a whole: see ckpt/commit/deletion.py).
  out += [deletion.name(s) for s, t in pending
          if t == records.DELETE and deletion.unfinished(storage, s)]
  if records.records_complete(storage):
    return out
  return out + [r for r in _abandoned_by_scan(storage, lease_s, reasons)
                if r not in out]


def _abandoned_by_scan(storage: storage_lib.Storage, lease_s: float,
                       reasons: dict | None = None) -> list[str]:
  """A root whose records are not complete: from one full listing."""
  out = []
  committed, attempts, loose = steps_lib._scan(storage)
  for s, tokens in sorted(attempts.items()):
    winner = steps_lib.committed_attempt(storage, s) if s in committed else None
    for t in sorted(tokens - {winner}):
      rel = steps_lib.work_dir(storage, s, t)
      # A committed step's losing attempts go once their lease is over too.
      if not _live(storage, rel, lease_s, reasons):
        out.append(rel)
  # Keys of an uncommitted step outside any attempt: a save by ckpt < 0.2
  # that never committed (today's saves write only inside attempts).
  out += [storage_lib.step_dirname(s) for s in sorted(loose - committed)
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
  if not storage_lib.is_deletable(rel):
    raise CheckpointError(
        f"refusing to delete {rel!r} in {storage.url!r}: ckpt deletes only "
        "checkpoint_<step>, checkpoint_<step>.tmp-<id> and "
        "checkpoint_<step>/attempt-<id> directories")
  step = storage_lib.parse_step(rel)
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
  step, token = storage_lib.parse_step(head), m.group(1)
  complete = records.records_complete(storage)
  committed, winner = steps_lib._commit_state(storage, step)
  if committed and winner == token:
    # The step itself (a commit that died before removing its pending
    # record, or a legacy root): only that record goes.
    storage.delete_key(records.pending_key(step, token))
    return
  if complete and not committed:
    marker = f"{storage_lib.step_dirname(step)}/{storage_lib.COMMIT_MARKER}"
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
  step = storage_lib.parse_step(name)
  if step is not None and not storage.is_posix:
    deletion.drop_leftovers(storage, step)
    return
  remove(storage, name)


def remove_attempt(storage: storage_lib.Storage, step: int, token: str) -> None:
  """Deletes one attempt that did not commit (never a committed step)."""
  remove(storage, steps_lib.work_dir(storage, step, token))
