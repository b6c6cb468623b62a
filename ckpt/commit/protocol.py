"""The commit protocol: how a save becomes a checkpoint, and what may be deleted.

Every save is one *attempt*, named by a token process 0 picks. Its data
goes into a work directory that nothing else writes into:

- POSIX file systems: ``checkpoint_<step>.tmp-<token>/``. The commit is one
  ``rename`` to ``checkpoint_<step>/``, which is atomic.
- Object stores and ``memory://`` (no rename):
  ``checkpoint_<step>/attempt-<token>/``. The commit is the marker
  ``checkpoint_<step>/commit_success``, written only if absent, naming the
  attempt, followed by the step's flat commit record (below); readers go
  from the record (a root written before records: the marker) to the
  attempt's index. A retry's late PUT, or a leftover process of an earlier
  attempt, can only write into its own attempt, never into the one that
  committed.

What a commit guarantees (``commit``):
- Every process wrote its data (the "written" barrier comes first) and the
  attempt is whole: its lease ``attempt.json`` is still the one this save
  last wrote (the renewal's last, conditional write: ckpt/commit/renewal.py)
  and, on object stores, its ``pending/`` record is there. Both are checked
  again after the step's record is written; a cleaner removes the lease
  first and reads the step's record after (ckpt/commit/cleanup.py), so one
  of the two sees the other: the commit takes its record and marker back
  and fails, or the cleaner sees it committed and keeps its data. A
  removed attempt is never recreated (renewals are conditional; writers
  that did recreate parts of it left no ``attempt.json``); the save fails
  with a CheckpointError saying its work was removed.
- On POSIX the index, the marker, every directory of the attempt and then
  the root are fsynced, in that order around the rename: after a power loss
  a committed step comes back whole or not at all (each process fsynced
  the data files it wrote before the "written" barrier: ckpt/save/durable.py).
- Two attempts at one step: the first commit wins; the other fails with an
  error saying the step was committed by another attempt (POSIX: the rename
  onto a non-empty directory fails; buckets: the marker is written only if
  absent, where the store supports conditional writes).

What cleanup may delete (``abandoned``, run by process 0 at every save):
attempts whose holder is provably dead or whose lease expired. A live
attempt's ``attempt.json`` is its lease (ckpt/commit/lease.py): it names the
process that holds it and a renewal number (process 0 renews it
every ``lease_s / 6`` while the save runs). An attempt is abandoned when its
holder ran on this machine and is gone (a crashed job restarted on the same
host), or when its lease is older than ``lease_s`` (default 30 s), or when
the file is missing and the directory (bucket: its ``pending/`` record)
itself is that old; ages are read on one clock (ckpt/commit/lease.py).
Half-done deletions (``*.tmp-del-*``) are always removable. A committed
step is never "abandoned"; deleting it (retention, ``ckpt gc``) removes its
record and marker first (buckets) or renames it away (POSIX), so no reader
ever sees half of it.

What a step is on a disk (``is_committed``, ``committed_steps``): a
``checkpoint_<step>/`` holding both its commit marker and its index (one
stat each per step; every format, OCDBT included, keeps ``index.msgpack``
as a plain file at the top of the step). A step directory whose index is
gone (a person, a partial copy: T5X's own test deletes it) is not
committed: nobody lists, restores or counts it (the latest step is the one
before), retention never deletes it, and errors about that step say what
is missing. A new save of that step sets it aside as
``checkpoint_<step>.broken-<id>`` (one rename; nothing is deleted: its
arrays may be worth recovering); only ``ckpt gc --incomplete`` deletes it
or any other incomplete step directory. A directory without a marker never
was a checkpoint and is replaced by that save, as before. On object stores
the record alone is the commit: a step whose index was deleted behind
ckpt's back stays listed, and restoring it fails, naming the missing index
(checking every step's index would cost a request per step in every
listing, which the records exist to avoid); ``ckpt ls`` shows it corrupt.

Two cleaners, one step (object stores): a deletion names the commit it
deletes, and whoever finishes it removes only that (see ckpt/commit/deletion.py).
Cleanup checks, then removes; between the two, another job may commit the
same step (a host stalled, a cleaner's first save alongside another job's
saves). So ``abandoned`` names an unfinished deletion by its record,
``pending/<step>.delete``, and ``remove`` of that name reads it again and
removes the attempt it names: that attempt's data, its marker (a delete
conditional on the generation read, only if it still names that attempt),
never a record or an attempt written since. A whole step found by a full
listing (a root without records) loses only the keys an earlier ckpt left
beside no marker (``remove_abandoned``).

Flat records (object stores and ``memory://``). Listing ``checkpoint_*``
on a bucket returns every key of every step (one per chunk with zarr:
millions at scale), so discovery never does it. Beside the step
directories, two flat prefixes hold one small object per step or attempt::

  <root>/commits/complete             the records below are complete (written
                                      once, before the root's first save)
  <root>/commits/<step>               the commit record of a committed step:
                                      the marker's JSON plus the step's save
                                      time and metrics, padded with spaces to
                                      RECORD_BYTES (4 KiB) so that one ranged
                                      GET reads it, in bounded memory
  <root>/pending/<step>.<token>       a save attempt not finished yet (its
                                      token and start time)
  <root>/pending/<step>.delete        a deletion of ``step`` in progress

- Commit: index, then the marker ``checkpoint_<step>/commit_success``
  (create-only: it still decides which attempt won, and stays the truth for
  a step directory copied alone), then ``commits/<step>``, then the
  attempt's ``pending/`` record goes. A step is committed (listed, restored,
  counted by retention) when its record exists: ``committed_steps`` is ONE
  listing of ``commits/`` (a page per 1,000 steps), ``step_dir``,
  ``is_committed`` and the metrics one GET of the record each.
- A marker without a record (a commit that died between the two writes, or
  a deletion that died after removing the record) is not committed: the
  save's ``pending/`` record (still there) or the deletion's lets cleanup
  find it; a later save of the same step removes such a marker first
  (``prepare``) once the attempt it names has no live lease.
- Deletion of a step: read the record (the attempt it names: the
  deletion's *target*), ``pending/<step>.delete`` naming that target, the
  record (if it is still the one read), the marker (if it still names the
  target), the target's data (``attempt-<token>/``; a step of ckpt < 0.2:
  the keys beside the marker, outside every ``attempt-*/``), then the
  ``pending`` record (if it is still this deletion's): a step is never
  listed once its deletion began, and a deletion that died is finished by
  cleanup (or by the next save of that step, before it writes anything, if
  the marker is still there), which removes only the target, whatever was
  committed since. A ``pending/<step>.delete`` written by an earlier ckpt
  names no target: finishing it removes what of ``checkpoint_<step>/`` no
  pending attempt, record or marker names, read in that order after
  listing the step's keys.
- Cleanup (``abandoned``) lists ``pending/`` only: what it costs grows with
  the attempts and deletions in progress, never with the chunks. A
  deletion whose target is still the step's record is not listed (it
  never got past the record, or is running now: the step stands).
- Compatibility: a root whose ``commits/complete`` is missing was written by
  an earlier ckpt (markers only) or copied from a disk. Readers then find
  its steps from one full listing of ``checkpoint_*`` per query, as earlier
  versions did; the first save into it (``prepare``) migrates it once: that
  listing, a record per committed step (its marker and index read once),
  a ``pending/`` record per uncommitted attempt, then ``commits/complete``.
  Do not let an earlier ckpt write into a migrated root: its steps would
  have no record.
- POSIX keeps its layout (one ``listdir`` of the root is proportional to the
  steps already) and writes no records; a root copied from a bucket to a
  disk drops the bucket's ``commits/`` and ``pending/`` at its first save or
  deletion there, so that copying it back never shows stale records.

This module writes an attempt and commits it (``prepare``, ``heartbeat``,
``commit``); which steps are committed and where their data is, is read by
ckpt/commit/steps.py, and cleanup (``abandoned``, ``remove``) is
ckpt/commit/cleanup.py. The agreement before ``commit`` is the save's
barriers (ckpt/save/runner.py), or, with writer processes, the writers'
records in the attempt (ckpt/commit/through_storage.py).
"""

from __future__ import annotations

from ckpt.commit import lease as lease_lib
from ckpt.commit import records
from ckpt.commit import renewal as renewal_lib
from ckpt.commit import cleanup as cleanup_lib
from ckpt.commit import attempt
from ckpt.commit import strategy
from ckpt.commit.attempt import ATTEMPT_FILE
from ckpt.store import storage as storage_lib


# ---- an attempt's life ------------------------------------------------------

def prepare(storage: storage_lib.Storage, step: int, token: str,
            lease_s: float = lease_lib.DEFAULT_LEASE_S,
            seen: lease_lib.Sightings | None = None) -> str:
  """Process 0, before anyone writes: a fresh work directory holding only
  ``attempt.json`` (and, on object stores, its ``pending/`` record).
  Returns its relative path. ``lease_s``, ``seen``: see
  ``MarkerCommit.clear_stale_marker`` (ckpt/commit/marker.py)."""
  return strategy.for_storage(storage).start_attempt(
      step, token, lease_s, seen, cleanup_lib)


def _attempt_token(storage: storage_lib.Storage, rel: str) -> str | None:
  return records.json_field(storage, f"{rel}/{ATTEMPT_FILE}", "token", str)


def _removed(kind: strategy.CommitKind, step: int, token: str,
             renewal: renewal_lib.Renewal | None) -> bytes | None:
  """Before a commit: the attempt is whole, or the removed_error. With the
  attempt's ``renewal``: its last word (the lease's generation now); then
  (object stores) its ``pending/`` record is there too."""
  storage, rel = kind.storage, kind.work_dir(step, token)
  where = f"{storage.url.rstrip('/')}/{rel}"
  if renewal is not None:
    gen = renewal.final()
  elif _attempt_token(storage, rel) != token:
    raise attempt.removed_error(step, where,
                                "its lease is gone or names another attempt")
  else:
    gen = None
  why = kind.pending_gone(step, token)
  if why is not None:
    raise attempt.removed_error(step, where, why)
  return gen


def commit(storage: storage_lib.Storage, step: int, token: str,
           index_data: bytes,
           renewal: renewal_lib.Renewal | None = None) -> None:
  """Writes the index and makes ``step`` visible (see the module
  docstring). ``renewal``: the attempt's lease renewal (process 0 of a
  save), stopped here; its last renewal proves the lease is the attempt's."""
  kind = strategy.for_storage(storage)
  lease_gen = _removed(kind, step, token, renewal)
  kind.publish(step, token, index_data, lease_gen)
