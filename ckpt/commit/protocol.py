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
  attempt is intact: ``attempt.json``, written when the attempt was
  prepared, still names this token. If anything removed the work directory
  meanwhile (another job's cleanup, an operator), the commit fails naming
  the cause; it never recreates it (writers that did recreate parts of it
  left no ``attempt.json``).
- On POSIX the index, the marker, every directory of the attempt and then
  the root are fsynced, in that order around the rename: after a power loss
  a committed step comes back whole or not at all (TensorStore's file
  driver fsyncs the data files it writes).
- Two attempts at one step: the first commit wins; the other fails with an
  error saying the step was committed by another attempt (POSIX: the rename
  onto a non-empty directory fails; buckets: the marker is written only if
  absent, where the store supports conditional writes).

What cleanup may delete (``abandoned``, run by process 0 at every save):
attempts whose holder is provably dead or whose lease expired. A live
attempt's ``attempt.json`` is its lease (ckpt/commit/lease.py): it names the
process that holds it and the time of its last renewal (process 0 renews it
every ``lease_s / 6`` while the save runs). An attempt is abandoned when its
holder ran on this machine and is gone (a crashed job restarted on the same
host), or when its lease is older than ``lease_s`` (default 30 s), or when
the file is missing and the directory itself is that old. Half-done
deletions (``*.tmp-del-*``) are always removable. A committed
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
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import time

from absl import logging
import msgpack

from ckpt.commit import deletion
from ckpt.commit import lease as lease_lib
from ckpt.commit import records
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError, CheckpointNotFoundError

ATTEMPT_FILE = "attempt.json"
ATTEMPT_PREFIX = "attempt-"
DEFAULT_LEASE_S = lease_lib.DEFAULT_LEASE_S
# TensorStore's generation of a key that does not exist: a write with
# ``if_equal=NO_VALUE`` creates the key only if it is absent.
NO_VALUE = b"\x02"
_DEL_RE = re.compile(r"^checkpoint_\d+\.tmp-del-[0-9a-f]+$")


def work_dir(storage: storage_lib.Storage, step: int, token: str) -> str:
  """The relative directory the attempt ``token`` at ``step`` writes into."""
  name = storage_lib.step_dirname(step)
  if storage.is_posix:
    return f"{name}.tmp-{records.check_token(token)}"
  return f"{name}/{ATTEMPT_PREFIX}{records.check_token(token)}"


def fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


# ---- an attempt's life ------------------------------------------------------

def prepare(storage: storage_lib.Storage, step: int, token: str,
            lease_s: float = DEFAULT_LEASE_S) -> str:
  """Process 0, before anyone writes: a fresh work directory holding only
  ``attempt.json`` (and, on object stores, its ``pending/`` record).
  Returns its relative path. ``lease_s``: see ``_clear_stale_marker``."""
  rel = work_dir(storage, step, token)
  if storage.is_posix:
    storage.root.mkdir(parents=True, exist_ok=True)
    _drop_bucket_records(storage)
    _clear_uncommitted_dir(storage, step)
    os.mkdir(storage.root / rel)  # fails if it exists: tokens are fresh
    storage_lib.write_file(os.fspath(storage.root / rel / ATTEMPT_FILE), lease_lib.make(token))
  else:
    try:
      _ensure_records(storage)
    except CheckpointError as e:
      # The root stays as it is (discovered by full listings); this save
      # goes on, and the next one tries again.
      logging.warning("ckpt: could not make the commit records of %s "
                      "complete: %s", storage.url, e)
    _clear_stale_marker(storage, step, lease_s)
    # first: cleanup can find the rest
    records.write_pending(storage, step, token)
    storage.write_bytes(f"{rel}/{ATTEMPT_FILE}", lease_lib.make(token))
  return rel


def _clear_uncommitted_dir(storage: storage_lib.Storage, step: int) -> None:
  """POSIX, preparing a save of ``step``: an uncommitted
  ``checkpoint_<step>/`` would make the commit rename fail on every try.
  Without a commit marker it never was a checkpoint (a partial copy, say):
  it goes. With a marker but no index it was one, and its arrays may be
  worth recovering by hand: it is renamed ``checkpoint_<step>.broken-<id>``,
  which nothing of ckpt reads or deletes, except ``ckpt gc --incomplete``."""
  name = storage_lib.step_dirname(step)
  path = os.path.join(os.fspath(storage.root), name)
  problem = posix_problem(storage, name)
  if problem is None or not os.path.isdir(path):
    return
  if not os.path.isfile(os.path.join(path, storage_lib.COMMIT_MARKER)):
    remove(storage, name)
    return
  aside = storage_lib.broken_name(step, secrets.token_hex(4))
  os.rename(path, os.path.join(os.fspath(storage.root), aside))
  fsync_dir(os.fspath(storage.root))
  logging.warning("ckpt: %s %s; a save of step %d needs its name, so it was "
                  "set aside as %s (nothing deleted; `ckpt gc --incomplete "
                  "--yes` deletes it)", path, problem, step, aside)


def heartbeat(storage: storage_lib.Storage, step: int, token: str) -> None:
  """Process 0, while the save runs: renews the attempt's lease (only if
  its directory still exists)."""
  rel = work_dir(storage, step, token)
  if storage.is_posix:
    storage_lib.write_file(os.fspath(storage.root / rel / ATTEMPT_FILE), lease_lib.make(token))
  else:
    storage.write_bytes(f"{rel}/{ATTEMPT_FILE}", lease_lib.make(token))


def _attempt_token(storage: storage_lib.Storage, rel: str) -> str | None:
  return records.json_field(storage, f"{rel}/{ATTEMPT_FILE}", "token", str)


def commit(storage: storage_lib.Storage, step: int, token: str,
           index_data: bytes) -> None:
  """Writes the index and makes ``step`` visible (see the module docstring)."""
  rel = work_dir(storage, step, token)
  final = storage_lib.step_dirname(step)
  where = f"{storage.url.rstrip('/')}/{rel}"
  if _attempt_token(storage, rel) != token:
    raise CheckpointError(
        f"cannot commit step {step}: its work directory {where} was removed "
        "or replaced while the save was running (another job's cleanup of "
        "abandoned saves, or a person?); nothing was committed and the "
        "existing checkpoints are untouched. Save again")
  if storage.is_posix:
    work = os.fspath(storage.root / rel)
    storage_lib.write_file(os.path.join(work, storage_lib.INDEX_NAME), index_data)
    storage_lib.write_file(os.path.join(work, storage_lib.COMMIT_MARKER),
                    records.marker(step, token, ""))
    for dirpath, _, _ in os.walk(work, topdown=False):
      fsync_dir(dirpath)  # every entry the checkpoint consists of, durable
    try:
      os.rename(work, storage.root / final)
    except OSError as e:
      if is_committed(storage, step):
        raise CheckpointError(
            f"cannot commit step {step} in {storage.url!r}: another attempt "
            f"committed it first; this attempt ({where}) was not committed") from e
      raise CheckpointError(
          f"cannot commit step {step}: renaming {where} to {final} failed "
          f"({type(e).__name__}: {e}); nothing was committed") from e
    fsync_dir(os.fspath(storage.root))
    return
  storage.write_bytes(f"{rel}/{storage_lib.INDEX_NAME}", index_data)
  marker_key = f"{final}/{storage_lib.COMMIT_MARKER}"
  data_dir = rel.split("/", 1)[1]
  with storage.store_errors(f"writing the commit marker of step {step} to"):
    storage.result(storage.kv.write(
        marker_key, records.marker(step, token, data_dir), if_equal=NO_VALUE))
  # A write whose condition failed is not an error in TensorStore; a retried
  # PUT of ours may also find our own marker. Read which attempt won.
  won = records.marker_attempt(storage.read_bytes(marker_key))
  if won != token:
    raise CheckpointError(
        f"cannot commit step {step} in {storage.url!r}: another attempt "
        f"committed it first; this attempt ({where}) was not committed")
  t, metrics = _index_info(index_data)
  # The record makes the step visible; then the attempt is no longer pending.
  storage.write_bytes(records.record_key(step),
                      records.record(step, token, data_dir, t, metrics))
  try:
    storage.delete_key(records.pending_key(step, token))
  except CheckpointError as e:  # committed all the same; cleanup drops it
    logging.warning("ckpt: step %d is committed, but removing %s failed: %s",
                    step, records.pending_key(step, token), e)


def _clear_stale_marker(storage: storage_lib.Storage, step: int,
                        lease_s: float) -> None:
  """Process 0, preparing a save of ``step`` (no record, records complete):
  a marker left without a record (a commit or a deletion that died half
  way) would make this attempt's commit fail. It goes when that is provably
  no live commit: the step's deletion is pending, or the attempt the marker
  names has no live lease. One GET when there is no such marker."""
  if not records.records_complete(storage):
    return  # without records, a marker is a commit
  key = f"{storage_lib.step_dirname(step)}/{storage_lib.COMMIT_MARKER}"
  if not storage.exists(key) or records.read_record(storage, step) is not None:
    return
  if storage.exists(deletion.name(step)):
    # Finish that deletion: it removes the marker only if it names the
    # commit that deletion deletes.
    deletion.finish(storage, step)
    if not storage.exists(key):
      return
  data, gen = storage.read_generation(key)
  won = records.marker_attempt(data)
  if data is None or (won is not None and _live(
      storage, work_dir(storage, step, won), lease_s)):
    return  # maybe a commit in progress: if it is, ours fails, naming it
  logging.warning("ckpt: step %d in %s has a commit marker but no commit "
                  "record (a save that died while committing); removing "
                  "that attempt (%s)", step, storage.url, won)
  if won is None:
    storage.delete_key(key, generation=gen)
  else:
    remove(storage, work_dir(storage, step, won))


# ---- migration of roots written before records ----------------------------

def _index_info(index_data: bytes) -> tuple[float | None, dict | None]:
  """(time, metrics) from an encoded index, reading only its top-level map
  up to them (best effort: None, None if it cannot)."""
  found: dict = {}
  try:
    u = msgpack.Unpacker(raw=False, strict_map_key=False,
                         max_buffer_size=max(len(index_data), 1))
    u.feed(index_data)
    for _ in range(u.read_map_header()):
      k = u.unpack()
      if k in ("time", "metrics"):
        found[k] = u.unpack()
        if len(found) == 2:
          break
      else:
        u.skip()
    t = found.get("time")
    t = float(t) if type(t) in (int, float) and math.isfinite(t) else None
    return t, records.check_metrics(found.get("metrics"), "the index")
  except Exception:  # pylint: disable=broad-except
    return None, None


def _ensure_records(storage: storage_lib.Storage) -> None:
  """Process 0, before a save writes anything: makes ``commits/`` complete
  (see "Compatibility" in the module docstring). Costs one GET once the
  root is migrated (then nothing, for this Storage)."""
  if records.records_complete(storage):
    return
  committed, attempts, loose = _scan(storage)  # the one full listing
  winners = {}
  for s in sorted(committed):
    key = f"{storage_lib.step_dirname(s)}/{storage_lib.COMMIT_MARKER}"
    data = storage.read_bytes(key)
    if data is None:
      continue  # deleted meanwhile
    token, data_dir = records.parse_marker(
        data, f"{storage.url.rstrip('/')}/{key}")
    winners[s] = token
    rel = storage_lib.step_dirname(s) + (f"/{data_dir}" if data_dir else "")
    t = metrics = None
    try:
      index = storage.read_bytes(storage.index_key(rel))
      if index is not None:
        t, metrics = _index_info(index)
    except CheckpointError as e:
      logging.warning("ckpt: migrating %s: the index of step %d is "
                      "unreadable (%s); its record holds no metrics",
                      storage.url, s, e)
    storage.write_bytes(records.record_key(s),
                        records.record(s, token, data_dir, t, metrics))
  for s, tokens in sorted(attempts.items()):
    for t in sorted(tokens - {winners.get(s)}):
      # its attempt.json says more
      records.write_pending(storage, s, t, time_s=0.0)
  for s in sorted(loose - committed - set(attempts)):
    # Keys of an uncommitted step outside any attempt: a save by ckpt < 0.2
    # that never committed (its deletion deletes only those).
    records.write_pending(storage, s, records.DELETE, time_s=0.0,
                          deletes=(None, ""))
  storage.write_bytes(records.RECORDS_COMPLETE, json.dumps(
      {"records": "complete", "migrated_steps": len(committed),
       "time": time.time()}).encode() + b"\n")
  storage.records_complete = True


def _drop_bucket_records(storage: storage_lib.Storage) -> None:
  """POSIX: a root copied from a bucket holds that bucket's records, which
  nothing maintains on a disk; before its steps change here they go, so a
  copy back to a bucket is migrated instead of trusting stale ones."""
  rec_dir = storage.root / storage_lib.RECORDS_DIR
  if not (rec_dir / "complete").is_file():
    return
  os.unlink(rec_dir / "complete")  # first: no false "complete" after a crash
  pending = storage.root / storage_lib.PENDING_DIR
  if pending.is_dir() and all(records.PENDING_RE.match(p.name)
                              for p in pending.iterdir()):
    shutil.rmtree(pending, ignore_errors=True)
  if all(records.STEP_NAME_RE.match(p.name) for p in rec_dir.iterdir()):
    shutil.rmtree(rec_dir, ignore_errors=True)


# ---- discovery --------------------------------------------------------------

def is_committed(storage: storage_lib.Storage, step: int) -> bool:
  name = storage_lib.step_dirname(step)
  if storage.is_posix:
    return posix_problem(storage, name) is None
  if records.records_complete(storage):
    return records.read_record(storage, step) is not None
  return storage.exists(f"{name}/{storage_lib.COMMIT_MARKER}")


def posix_problem(storage: storage_lib.Storage, name: str) -> str | None:
  """Why the directory ``name`` (``checkpoint_<step>``) of a POSIX root is
  not a committed step; None if it is. Committed: its commit marker and
  its index are both there (a stat each; a step copied from a bucket, whose
  index is in the attempt its marker names, reads the marker too)."""
  path = os.path.join(os.fspath(storage.root), name)
  if not os.path.exists(os.path.join(path, storage_lib.COMMIT_MARKER)):
    return ("has no commit marker (commit_success)" if os.path.isdir(path)
            else "does not exist")
  # Anything at the index's name counts: one that is not a regular file (a
  # FIFO, a link out of the step) is a corrupt step that reading refuses,
  # naming it, not a missing one.
  if os.path.lexists(os.path.join(path, storage_lib.INDEX_NAME)):
    return None
  key = f"{name}/{storage_lib.COMMIT_MARKER}"
  try:
    _, data_dir = records.parse_marker(storage.read_bytes(key) or b"",
                                       f"{path}/{storage_lib.COMMIT_MARKER}")
  except CheckpointError:
    data_dir = ""
  if data_dir and os.path.lexists(os.path.join(path, data_dir,
                                               storage_lib.INDEX_NAME)):
    return None
  where = f"{data_dir}/" if data_dir else ""
  return f"has a commit marker but no {where}{storage_lib.INDEX_NAME}"


def not_committed(storage: storage_lib.Storage, step: int,
                  doing: str = "") -> CheckpointNotFoundError:
  """The one wording of "``step`` is not committed" (restore, metadata,
  metrics, delete ...): what is wrong with its directory, if it has one,
  and the committed steps. ``doing``: a prefix, e.g. "cannot delete step 5"."""
  why = not_committed_reason(storage, step)
  return CheckpointNotFoundError(
      f"{doing + ': ' if doing else ''}step {step} is not a committed "
      f"checkpoint in {storage.url!r}{f': {why}' if why else ''}; committed "
      f"steps: {committed_steps(storage)}")


def not_committed_reason(storage: storage_lib.Storage, step: int
                         ) -> str | None:
  """For errors: what is wrong with ``step``'s directory if it has one but
  is not committed (POSIX; None elsewhere, or when there is no such
  directory)."""
  if not storage.is_posix:
    return None
  name = storage_lib.step_dirname(step)
  problem = posix_problem(storage, name)
  if problem is None or problem == "does not exist":
    return None
  return (f"{os.path.join(os.fspath(storage.root), name)} {problem} (deleted, "
          "or never copied?)")


def step_of(name: str) -> int:
  """The step an entry of ``abandoned`` (or a POSIX root's listing) is
  about."""
  s = deletion.parse_name(name)
  if s is not None:
    return s
  return int(re.match(r"checkpoint_(\d+)", name).group(1))


def step_dir(storage: storage_lib.Storage, step: int) -> str:
  """The relative directory holding ``step``'s index and data."""
  name = storage_lib.step_dirname(step)
  if records.records_complete(storage):
    rec = records.read_record(storage, step)
    if rec is None:
      raise not_committed(storage, step)
    return f"{name}/{rec['dir']}" if rec["dir"] else name
  key = f"{name}/{storage_lib.COMMIT_MARKER}"
  data = storage.read_bytes(key)
  if data is None:
    raise not_committed(storage, step)
  _, data_dir = records.parse_marker(data, f"{storage.url.rstrip('/')}/{key}")
  return f"{name}/{data_dir}" if data_dir else name


def _commit_state(storage: storage_lib.Storage, step: int
                  ) -> tuple[bool, str | None]:
  """(whether ``step`` is committed, the token of the attempt that
  committed it): one read."""
  if records.records_complete(storage):
    rec = records.read_record(storage, step)
    return rec is not None, rec and rec["attempt"]
  data = storage.read_bytes(
      f"{storage_lib.step_dirname(step)}/{storage_lib.COMMIT_MARKER}")
  return data is not None, records.marker_attempt(data)


def committed_attempt(storage: storage_lib.Storage, step: int) -> str | None:
  """The token of the attempt that committed ``step`` (None: not committed,
  or committed by a ckpt that did not record it)."""
  return _commit_state(storage, step)[1]


def own_step_dir(storage: storage_lib.Storage) -> str | None:
  """When the storage URL is itself one step's directory: its data
  directory ("" or "attempt-<token>"); else None."""
  data = storage.read_bytes(storage_lib.COMMIT_MARKER)
  if data is not None:
    return records.parse_marker(data, f"{storage.url.rstrip('/')}/"
                         f"{storage_lib.COMMIT_MARKER}")[1]
  if storage.read_bytes(storage_lib.INDEX_NAME) is not None:
    return ""  # a step directory copied without its marker
  # A bucket's step directory copied without its marker: the one attempt
  # that holds an index, if there is exactly one.
  if storage.is_posix:
    if not storage.root.is_dir():
      return None
    found = sorted(p.name for p in storage.root.iterdir()
                   if records.ATTEMPT_DIR_RE.match(p.name)
                   and (p / storage_lib.INDEX_NAME).exists())
  else:
    found = sorted({k.split("/")[0] for k in storage.list_keys(ATTEMPT_PREFIX)
                    if k.endswith("/" + storage_lib.INDEX_NAME)
                    and records.ATTEMPT_DIR_RE.match(k.split("/")[0])
                    and k.count("/") == 1})
  if len(found) > 1:
    raise CheckpointError(
        f"{storage.url!r} has no commit marker and {len(found)} attempts "
        f"with an index ({found}); name the one to read "
        f"({storage.url.rstrip('/')}/{found[0]})")
  return found[0] if found else None


def committed_steps(storage: storage_lib.Storage) -> list[int]:
  """The committed steps, sorted. POSIX: one listing of the root. Object
  stores: one listing of ``commits/`` (a root not migrated yet: of every
  key under ``checkpoint_*``, see the module docstring)."""
  if storage.is_posix:
    if not storage.root.exists():
      return []
    steps = [storage_lib.parse_step(p.name) for p in storage.root.iterdir()]
    return sorted(s for s in steps if s is not None and is_committed(storage, s))
  names = [k[len(records.RECORDS):]
           for k in storage.list_keys(records.RECORDS)]
  if storage.records_complete or "complete" in names:
    storage.records_complete = True
    return sorted(int(n) for n in names if records.STEP_NAME_RE.match(n))
  return sorted(_scan(storage)[0])


def _scan(storage: storage_lib.Storage):
  """From ONE listing of every key under ``checkpoint_*`` of a bucket (a
  root whose records are not complete): (committed steps, {step: attempt
  tokens}, steps holding keys outside any attempt)."""
  committed, attempts, loose = set(), {}, set()
  for key in storage.list_keys(storage_lib.STEP_PREFIX):
    head, _, tail = key.partition("/")
    s = storage_lib.parse_step(head)
    if s is None or not tail:
      continue
    first, _, rest = tail.partition("/")
    m = records.ATTEMPT_DIR_RE.match(first)
    if tail == storage_lib.COMMIT_MARKER:
      committed.add(s)
    elif m and rest:
      attempts.setdefault(s, set()).add(m.group(1))
    else:
      loose.add(s)
  return committed, attempts, loose


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
  lease = lease_lib.parse(storage.read_bytes(f"{rel}/{ATTEMPT_FILE}"))
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
  return all(n.startswith(f"{ATTEMPT_FILE}.partial-") for n in names)


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
    rel = work_dir(storage, s, t)
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
  committed, attempts, loose = _scan(storage)
  for s, tokens in sorted(attempts.items()):
    winner = committed_attempt(storage, s) if s in committed else None
    for t in sorted(tokens - {winner}):
      rel = work_dir(storage, s, t)
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
        _drop_bucket_records(storage)
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
  committed, winner = _commit_state(storage, step)
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
  remove(storage, work_dir(storage, step, token))


def guard(storage: storage_lib.Storage, step: int):
  """A check that ``step`` is still the one committed now (the attempt its
  marker names has not changed), for lazy leaves: they read only the data
  they were made from, or raise."""
  token = committed_attempt(storage, step)

  def check() -> None:  # one read of the record (or the marker)
    committed, now = _commit_state(storage, step)
    if not committed:
      what = "deleted"
    elif now != token:
      what = "deleted and saved again"
    else:
      return
    raise CheckpointError(
        f"step {step} in {storage.url!r} was {what} after this lazy leaf was "
        "created (by retention or another job): the leaf's data is gone, and "
        "ckpt never reads other data in its place. Restore again from a "
        "step that exists")
  return check
