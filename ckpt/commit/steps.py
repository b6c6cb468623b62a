"""Which steps of a root are committed, and where each one's data is.

The read side of the commit protocol (ckpt/commit/protocol.py describes the
layout): ``is_committed``, ``committed_steps``, ``step_dir`` and the reasons
a step is not committed, the committed attempt of a step and the guard that
a lazy restore keeps on it. What differs between POSIX and object stores
(work directories, discovery, the records' one-time migration) is in
ckpt/commit/strategy.py. Nothing here writes a step.
"""

from __future__ import annotations

import re

from ckpt.commit import deletion
from ckpt.commit import records
from ckpt.commit import strategy
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError, CheckpointNotFoundError
from ckpt.store import names as names_lib


def work_dir(storage: storage_lib.Storage, step: int, token: str) -> str:
  """The relative directory the attempt ``token`` at ``step`` writes into."""
  return strategy.for_storage(storage).work_dir(step, token)


# ---- discovery --------------------------------------------------------------

def is_committed(storage: storage_lib.Storage, step: int) -> bool:
  return strategy.for_storage(storage).is_committed(step)


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
  return strategy.for_storage(storage).not_committed_reason(step)


def step_of(name: str) -> int:
  """The step an entry of ``abandoned`` (or a POSIX root's listing) is
  about."""
  s = deletion.parse_name(name)
  if s is not None:
    return s
  return int(re.match(r"checkpoint_(\d+)", name).group(1))


def step_dir(storage: storage_lib.Storage, step: int) -> str:
  """The relative directory holding ``step``'s index and data."""
  name = names_lib.step_dirname(step)
  if records.records_complete(storage):
    rec = records.read_record(storage, step)
    if rec is None:
      raise not_committed(storage, step)
    return f"{name}/{rec['dir']}" if rec["dir"] else name
  key = f"{name}/{names_lib.COMMIT_MARKER}"
  data = storage.read_bytes(key)
  if data is None:
    raise not_committed(storage, step)
  _, data_dir = records.parse_marker(data, f"{storage.url.rstrip('/')}/{key}")
  return f"{name}/{data_dir}" if data_dir else name


def committed_attempt(storage: storage_lib.Storage, step: int) -> str | None:
  """The token of the attempt that committed ``step`` (None: not committed,
  or committed by a ckpt that did not record it)."""
  return records.commit_state(storage, step)[1]


def own_step_dir(storage: storage_lib.Storage) -> str | None:
  """When the storage URL is itself one step's directory: its data
  directory ("" or "attempt-<token>"); else None."""
  data = storage.read_bytes(names_lib.COMMIT_MARKER)
  if data is not None:
    return records.parse_marker(data, f"{storage.url.rstrip('/')}/"
                         f"{names_lib.COMMIT_MARKER}")[1]
  if storage.read_bytes(names_lib.INDEX_NAME) is not None:
    return ""  # a step directory copied without its marker
  # A bucket's step directory copied without its marker: the one attempt
  # that holds an index, if there is exactly one.
  found = strategy.for_storage(storage).attempts_with_index()
  if len(found) > 1:
    raise CheckpointError(
        f"{storage.url!r} has no commit marker and {len(found)} attempts "
        f"with an index ({found}); name the one to read "
        f"({storage.url.rstrip('/')}/{found[0]})")
  return found[0] if found else None


def committed_steps(storage: storage_lib.Storage) -> list[int]:
  """The committed steps, sorted. POSIX: one listing of the root. Object
  stores: one listing of ``commits/`` (a root not migrated yet: of every
  key under ``checkpoint_*``, see ckpt/commit/protocol.py)."""
  return strategy.for_storage(storage).committed_steps()


def guard(storage: storage_lib.Storage, step: int):
  """A check that ``step`` is still the one committed now (the attempt its
  marker names has not changed), for lazy leaves: they read only the data
  they were made from, or raise."""
  token = committed_attempt(storage, step)

  def check() -> None:  # one read of the record (or the marker)
    committed, now = records.commit_state(storage, step)
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
