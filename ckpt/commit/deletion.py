"""Deleting a whole step from an object store, and finishing a deletion that
died half way (the protocol is in ckpt/commit/protocol.py's module docstring).

A deletion names the commit it deletes. Before anything goes,
``pending/<step>.delete`` records the attempt (token and data directory)
that the step's record names; then the record goes (only if it is still
the one read), the marker (only if it still names that attempt), that
attempt's data, and the ``pending`` record. Whoever finishes a deletion
that died (cleanup, or the next save of that step) does the same from the
``pending`` record, at the time it does it, never from what it saw earlier:
a save of the same step that committed meanwhile (another job, while the
cleaner was stalled between its check and its removals) writes a fresh
attempt, record and marker, and none of them is what the deletion names.

Deletes conditional on the generation read are atomic on TensorStore's
memory, file and gcs drivers; on s3 TensorStore checks with a HEAD, then
deletes. Only the marker can be hit in that gap (a new commit's marker
written in the milliseconds between the two requests, after someone else
removed the old one): the new commit stays committed (its record is what
makes it so), and its data and record are never named by the deletion.
"""

from __future__ import annotations

import re

from absl import logging

from ckpt.commit import attempt
from ckpt.commit import held
from ckpt.commit import records
from ckpt.store import storage as storage_lib
from ckpt.errors import CorruptCheckpointError
from ckpt.store import names

_NAME_RE = re.compile(r"^" + re.escape(records.PENDING)
                      + r"(0|[1-9][0-9]{0,18})\." + records.DELETE + "$")


def name(step: int) -> str:
  """How ``commit.abandoned`` names an unfinished deletion of ``step`` (its
  ``pending`` record); ``commit.remove`` of that name finishes it."""
  return records.pending_key(step, records.DELETE)


def parse_name(rel: str) -> int | None:
  m = _NAME_RE.match(rel)
  return int(m.group(1)) if m else None


def _marker_key(step: int) -> str:
  return f"{names.step_dirname(step)}/{names.COMMIT_MARKER}"


def _where(storage: storage_lib.Storage, key: str) -> str:
  return f"{storage.url.rstrip('/')}/{key}"


def _data_dir_of(key: str) -> str:
  """The attempt directory a key of ``checkpoint_<step>/`` is in ("": beside
  the marker)."""
  first, sep, _ = key.partition("/")[2].partition("/")
  return first if sep and records.ATTEMPT_DIR_RE.match(first) else ""


def _named(storage: storage_lib.Storage, step: int, data: bytes
           ) -> tuple[str | None, str] | None:
  """(attempt, data directory) a marker names; None if it is unreadable."""
  try:
    return records.parse_marker(data, _where(storage, _marker_key(step)))
  except CorruptCheckpointError:
    return None


# ---- deleting a step ----------------------------------------------------------

def remove_step(storage: storage_lib.Storage, step: int) -> None:
  """Deletes ``step`` as it is committed now (retention, ``delete()``,
  ``ckpt gc``): the attempt its record names (a root without records: its
  marker), unlisted first. A step with neither: only what an earlier ckpt
  wrote beside the marker (never an attempt's data: a save may be
  running)."""
  key = records.record_key(step)
  if storage.exists(name(step)):
    # An earlier deletion of this step that died: finished first, so that
    # this one's pending record does not replace what it still has to do.
    finish(storage, step)
  rec = data = rec_gen = None
  complete = records.records_complete(storage)
  if complete:
    data, rec_gen = storage.read_generation(key)
    if data is not None:
      try:
        rec = records.parse_record(data, step, _where(storage, key))
      except CorruptCheckpointError as e:  # it goes; the marker says what
        logging.warning("ckpt: deleting step %d: %s", step, e)
  marker = None
  if rec is None and (data is not None or not complete):
    # A root without records (the marker commits), or a damaged record.
    marker = storage.read_bytes(_marker_key(step))
  if rec is not None:
    target = (rec["attempt"], rec["dir"])
  elif marker is not None:
    target = _named(storage, step, marker) or (None, "")
  else:
    target = (None, "")
  gen = records.write_pending(storage, step, records.DELETE, deletes=target)
  if data is not None:
    storage.delete_key(key, generation=rec_gen)
  _drop(storage, step, target)
  storage.delete_key(name(step), generation=gen)


def drop_leftovers(storage: storage_lib.Storage, step: int) -> None:
  """The keys an earlier ckpt (no attempts) left in ``checkpoint_<step>/``
  beside no marker: a save that never committed, found by a full listing
  of a root without records (``MarkerCommit.abandoned``,
  ckpt/commit/marker.py). Only keys outside the attempts' directories go,
  and nothing once a marker exists: a save of that step by this ckpt,
  committed since that listing, keeps its data, marker and record."""
  if storage.exists(_marker_key(step)):
    return
  step_name = names.step_dirname(step)
  storage.delete_keys([k for k in storage.list_keys(f"{step_name}/")
                       if not _data_dir_of(k)], f"step {step}")


def _drop(storage: storage_lib.Storage, step: int,
          target: tuple[str | None, str]) -> None:
  """The marker, if it still names ``target``; then ``target``'s data."""
  marker = _marker_key(step)
  data, gen = storage.read_generation(marker)
  if data is not None and _named(storage, step, data) == target:
    storage.delete_key(marker, generation=gen)
  what = f"step {step}"
  step_name = names.step_dirname(step)
  if target[1]:
    # What later steps hold here stays (ckpt/commit/held.py); the arrays
    # this step held elsewhere are swept once it is gone, its index last.
    where = f"{step_name}/{target[1]}"
    index_key = storage.index_key(where)
    refers = held.referred(storage, where)
    keys = held.kept(storage.list_keys(f"{where}/"), where,
                     held.marks(storage, step, target[1]))
    storage.delete_keys([k for k in keys if k != index_key], what)
    held.sweep(storage, refers)
    if index_key in keys:
      storage.delete_keys([index_key], what)
  else:  # beside the marker: every key outside the attempts' directories
    storage.delete_keys([k for k in storage.list_keys(f"{step_name}/")
                         if k != marker and not _data_dir_of(k)], what)


# ---- finishing a deletion that died -----------------------------------------

def unfinished(storage: storage_lib.Storage, step: int) -> bool:
  """Whether ``pending/<step>.delete`` is a deletion for cleanup to finish:
  it exists and the step's record is not the commit it deletes (if it is,
  that deletion never got past the record, or is running now: the step
  stands). One naming no attempt: only while the step has no record."""
  data = storage.read_bytes(name(step))
  if data is None:
    return False
  rec = records.read_record(storage, step)
  if rec is None:
    return True
  target = records.deletion_target(data)
  return target is not None and (rec["attempt"], rec["dir"]) != target


def finish(storage: storage_lib.Storage, step: int) -> None:
  """Finishes the deletion ``pending/<step>.delete`` records (if it is
  still there): only what it names, then that pending record (only if it
  is still the one read here)."""
  data, gen = storage.read_generation(name(step))
  if data is None:
    return  # finished by someone else
  target = records.deletion_target(data)
  if target is None:
    _finish_unnamed(storage, step)
  else:
    rec = records.read_record(storage, step)
    if rec is not None and (rec["attempt"], rec["dir"]) == target:
      return  # it never removed the record: the step stands
    _drop(storage, step, target)
  storage.delete_key(name(step), generation=gen)


def _finish_unnamed(storage: storage_lib.Storage, step: int) -> None:
  """A deletion whose pending record names no attempt (an earlier ckpt
  wrote it): removes what of ``checkpoint_<step>/`` nobody names.

  Read in this order: the step's keys, ``pending/``, the record, the
  marker. A save writes its pending record before any key and removes it
  only after its record, so an attempt whose keys were listed is either
  still pending, or named by the record, or dead; keys written after the
  listing are not touched."""
  marker = _marker_key(step)
  keys = storage.list_keys(f"{names.step_dirname(step)}/")
  kept = {f"{attempt.ATTEMPT_PREFIX}{t}" for s, t in records.list_pending(storage)
          if s == step and t != records.DELETE}
  rec = records.read_record(storage, step)
  if rec is not None:
    kept.add(rec["dir"])
  data, gen = storage.read_generation(marker)
  named = None if data is None else _named(storage, step, data)
  marker_kept = data is not None and (
      named is None  # unreadable: not ours to judge
      or not records.records_complete(storage)  # then the marker commits
      or named[1] in kept - {""}  # a commit in progress
      or (rec is not None and (rec["attempt"], rec["dir"]) == named))
  if marker_kept and named is not None:
    kept.add(named[1])
  if data is not None and not marker_kept:
    storage.delete_key(marker, generation=gen)
  storage.delete_keys([k for k in keys
                       if k != marker and _data_dir_of(k) not in kept],
                      f"step {step}")
