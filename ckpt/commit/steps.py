"""Which steps of a root are committed, and where each one's data is.

The read side of the commit protocol (ckpt/commit/protocol.py describes the
layout): the names of attempts and their lease file, ``is_committed``,
``committed_steps``, ``step_dir`` and the reasons a step is not committed,
the committed attempt of a step and the guard that a lazy restore keeps on
it, and the flat commit records of object stores (their one-time migration
from markers, ``ensure_records``, and their removal from a root copied to a
disk). Nothing here writes a step.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time

from absl import logging
import msgpack

from ckpt.commit import deletion
from ckpt.commit import records
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError, CheckpointNotFoundError

ATTEMPT_FILE = "attempt.json"


ATTEMPT_PREFIX = "attempt-"


# TensorStore's generation of a key that does not exist: a write with
# ``if_equal=NO_VALUE`` creates the key only if it is absent.
NO_VALUE = b"\x02"


def work_dir(storage: storage_lib.Storage, step: int, token: str) -> str:
  """The relative directory the attempt ``token`` at ``step`` writes into."""
  name = storage_lib.step_dirname(step)
  if storage.is_posix:
    return f"{name}.tmp-{records.check_token(token)}"
  return f"{name}/{ATTEMPT_PREFIX}{records.check_token(token)}"


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


def ensure_records(storage: storage_lib.Storage) -> None:
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
