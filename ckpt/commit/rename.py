"""POSIX file systems: an attempt writes into ``checkpoint_<step>.tmp-<token>/``
and its commit is one atomic ``rename`` to ``checkpoint_<step>/``; a step is
committed when its directory holds the commit marker and the index; no flat
records (ckpt/commit/protocol.py describes the protocol)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
from typing import Callable

from absl import logging

from ckpt.commit import lease as lease_lib
from ckpt.commit import records
from ckpt.commit.attempt import (ATTEMPT_FILE, Cleaner, committed_elsewhere,
                                 fsync_dir, removed_error)
from ckpt.store import names
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError


_DEL_RE = re.compile(r"^checkpoint_\d+\.tmp-del-[0-9a-f]+$")


def store_now(storage: storage_lib.Storage) -> float | None:
  """Now on the file system's clock (ckpt/commit/lease.py): the
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


class FileClock:
  """How one cleanup pass dates leases on a disk: their modification time
  against the file system's clock, read once (lazily) per pass."""

  def __init__(self, storage: storage_lib.Storage):
    self.storage = storage
    self._now: list = []

  def age_s(self, rel: str, generation: bytes | None) -> float | None:
    """Seconds since the attempt at ``rel`` last changed (None: unknown)."""
    del generation  # a file's mtime says it
    root = self.storage.root
    t = _mtime(root / rel / ATTEMPT_FILE)
    if t is None:
      t = _mtime(root / rel)
    if t is None:
      return None
    if not self._now:
      self._now.append(store_now(self.storage))
    return None if self._now[0] is None else self._now[0] - t

  def forget_unseen(self) -> None:
    """Nothing to forget: a file's age is read from the file."""


# A lease or marker is a few hundred bytes: read that much first, since
# ``read(n)`` allocates n bytes before reading (32 MiB a read, at every
# renewal and commit).
_FIRST_READ = 64 << 10


def _read(path: str) -> bytes | None:
  """At most ``MAX_OBJECT_BYTES`` of the file, or None if it cannot be
  read."""
  try:
    with open(path, "rb") as f:
      data = f.read(_FIRST_READ)
      if len(data) == _FIRST_READ:
        data += f.read(storage_lib.MAX_OBJECT_BYTES - _FIRST_READ)
      return data
  except OSError:
    return None


class FileLease:
  """An attempt's lease on a disk, rewritten in place while it is there
  (ckpt/commit/renewal.py renews it)."""

  generation = None  # a file has none

  def __init__(self, storage: storage_lib.Storage, key: str):
    self.path = os.path.join(os.fspath(storage.root), key)

  def prime(self) -> str | None:
    """Nothing to read ahead on a disk (see ObjectLease.prime)."""
    return None

  def renew(self, data: bytes, count: int) -> str | None:
    """Writes ``data`` (renewal ``count``); why the lease is lost, or None."""
    del count  # the file itself says whether it is still there
    if lease_lib.parse(_read(self.path)) is None:
      return "its lease is gone"
    try:
      storage_lib.write_file(self.path, data)
    except FileNotFoundError:
      return "its directory is gone"
    return None


class RenameCommit:
  """POSIX: commit by renaming the attempt's directory (module docstring)."""

  def __init__(self, storage: storage_lib.Storage):
    self.storage = storage

  # The shortest time between two renewals of a lease (a file write).
  least_renewal_s = 0.05

  def lease(self, key: str, token: str, request_s: float) -> FileLease:
    del token, request_s  # a file write is local and names no attempt
    return FileLease(self.storage, key)

  # How an expired lease's age reads in a reason.
  stale_lease = "its lease was last written {age:.0f} s ago"

  def clock(self, seen: lease_lib.Sightings | None) -> FileClock:
    del seen  # leases are dated by their files
    return FileClock(self.storage)

  def holds_nothing(self, rel: str) -> bool:
    """The attempt directory holds at most a lease being written."""
    try:
      found = os.listdir(self.storage.root / rel)
    except OSError:
      return False
    return all(n.startswith(f"{ATTEMPT_FILE}.partial-") for n in found)

  def abandoned(self, live: Callable[[str], bool | None]) -> list[str]:
    """One listing of the root: half-done deletions (``*.tmp-del-*``) and
    the attempts ``live`` says are not (None, an unknown age: kept)."""
    if not self.storage.root.exists():
      return []
    out = []
    for p in sorted(self.storage.root.iterdir()):
      if _DEL_RE.match(p.name):
        out.append(p.name)
      elif names.is_tmp_name(p.name) and live(p.name) is False:
        out.append(p.name)
    return out

  def finish_deletion(self, rel: str) -> bool:
    """A disk names no deletion records: False."""
    del rel
    return False

  def remove_leftovers(self, step: int) -> bool:
    """A disk's whole step is removed as any step is: False."""
    del step
    return False

  def remove(self, rel: str, step: int | None, what: str) -> None:
    """One atomic rename first (a committed step vanishes at once, and a
    save still writing into an attempt can no longer commit it), then the
    renamed directory goes."""
    storage = self.storage
    path = storage.root / rel
    with storage.store_errors(f"deleting {what} from"):
      if not path.exists():
        return
      if step is not None:
        self.forget_bucket_records()
      if not _DEL_RE.match(rel):
        head = rel.split(".", 1)[0]
        doomed = storage.root / f"{head}.tmp-del-{secrets.token_hex(4)}"
        os.rename(path, doomed)
        path = doomed
      shutil.rmtree(path, ignore_errors=True)

  def work_dir(self, step: int, token: str) -> str:
    """The relative directory the attempt ``token`` at ``step`` writes into."""
    return f"{names.step_dirname(step)}.tmp-{records.check_token(token)}"

  def write_into_attempt(self, work_dir: str, rel: str, data: bytes,
                         what: str) -> None:
    """A small file of this process into the attempt. Never recreates the
    attempt's directory (if it was removed, the commit fails on its missing
    attempt.json): only the per-process subdirectory."""
    sub, name = rel.rsplit("/", 1)
    folder = os.path.join(os.fspath(self.storage.root), work_dir, sub)
    with self.storage.store_errors(f"writing {what} to"):
      try:
        os.mkdir(folder)
      except FileExistsError:
        pass
      storage_lib.write_file(os.path.join(folder, name), data)

  def ensure_records(self) -> None:
    """A disk keeps no commit records: nothing to complete."""

  def is_committed(self, step: int) -> bool:
    return self.problem(names.step_dirname(step)) is None

  def problem(self, name: str) -> str | None:
    """Why the directory ``name`` (``checkpoint_<step>``) is not a committed
    step; None if it is. Committed: its commit marker and its index are
    both there (a stat each; a step copied from a bucket, whose index is in
    the attempt its marker names, reads the marker too)."""
    path = os.path.join(os.fspath(self.storage.root), name)
    if not os.path.exists(os.path.join(path, names.COMMIT_MARKER)):
      return ("has no commit marker (commit_success)" if os.path.isdir(path)
              else "does not exist")
    # Anything at the index's name counts: one that is not a regular file (a
    # FIFO, a link out of the step) is a corrupt step that reading refuses,
    # naming it, not a missing one.
    if os.path.lexists(os.path.join(path, names.INDEX_NAME)):
      return None
    key = f"{name}/{names.COMMIT_MARKER}"
    try:
      _, data_dir = records.parse_marker(self.storage.read_bytes(key) or b"",
                                         f"{path}/{names.COMMIT_MARKER}")
    except CheckpointError:
      data_dir = ""
    if data_dir and os.path.lexists(os.path.join(path, data_dir,
                                                 names.INDEX_NAME)):
      return None
    where = f"{data_dir}/" if data_dir else ""
    return f"has a commit marker but no {where}{names.INDEX_NAME}"

  def not_committed_reason(self, step: int) -> str | None:
    """What is wrong with ``step``'s directory if it has one but is not
    committed (None when there is no such directory)."""
    name = names.step_dirname(step)
    problem = self.problem(name)
    if problem is None or problem == "does not exist":
      return None
    return (f"{os.path.join(os.fspath(self.storage.root), name)} {problem} "
            "(deleted, or never copied?)")

  def committed_steps(self) -> list[int]:
    """One listing of the root."""
    if not self.storage.root.exists():
      return []
    steps = [names.parse_step(p.name) for p in self.storage.root.iterdir()]
    return sorted(s for s in steps
                  if s is not None and self.is_committed(s))

  def attempts_with_index(self) -> list[str]:
    """The ``attempt-<token>`` directories holding an index, when the
    storage URL is one step's directory copied from a bucket."""
    if not self.storage.root.is_dir():
      return []
    return sorted(p.name for p in self.storage.root.iterdir()
                  if records.ATTEMPT_DIR_RE.match(p.name)
                  and (p / names.INDEX_NAME).exists())

  def read_lease(self, key: str) -> tuple[bytes | None, bytes | None]:
    """(the lease's bytes or None, its generation: None on a disk)."""
    return self.storage.read_bytes(key), None

  def pending_gone(self, step: int, token: str) -> str | None:
    """Why the attempt's ``pending/`` record is missing: a disk has none."""
    del step, token
    return None

  def forget_bucket_records(self) -> None:
    """A root copied from a bucket holds that bucket's records, which
    nothing maintains on a disk; before its steps change here they go, so a
    copy back to a bucket is migrated instead of trusting stale ones."""
    rec_dir = self.storage.root / names.RECORDS_DIR
    if not (rec_dir / "complete").is_file():
      return
    os.unlink(rec_dir / "complete")  # first: no false "complete" after a crash
    pending = self.storage.root / names.PENDING_DIR
    if pending.is_dir() and all(records.PENDING_RE.match(p.name)
                                for p in pending.iterdir()):
      shutil.rmtree(pending, ignore_errors=True)
    if all(records.STEP_NAME_RE.match(p.name) for p in rec_dir.iterdir()):
      shutil.rmtree(rec_dir, ignore_errors=True)

  def start_attempt(self, step: int, token: str, lease_s: float, seen,
                    cleaner: Cleaner) -> str:
    """The attempt's fresh directory holding only its lease; the root's
    stale bucket records and an uncommitted ``checkpoint_<step>/`` go
    first. Returns its relative path."""
    storage = self.storage
    del lease_s, seen  # a rename onto a committed step fails by itself
    rel = self.work_dir(step, token)
    storage.root.mkdir(parents=True, exist_ok=True)
    self.forget_bucket_records()
    self.clear_uncommitted_dir(step, cleaner)
    os.mkdir(storage.root / rel)  # fails if it exists: tokens are fresh
    storage_lib.write_file(os.fspath(storage.root / rel / ATTEMPT_FILE),
                           lease_lib.make(token))
    return rel

  def clear_uncommitted_dir(self, step: int, cleaner: Cleaner) -> None:
    """Preparing a save of ``step``: an uncommitted ``checkpoint_<step>/``
    would make the commit rename fail on every try. Without a commit marker
    it never was a checkpoint (a partial copy, say): it goes. With a marker
    but no index it was one, and its arrays may be worth recovering by
    hand: it is renamed ``checkpoint_<step>.broken-<id>``, which nothing of
    ckpt reads or deletes, except ``ckpt gc --incomplete``."""
    storage = self.storage
    name = names.step_dirname(step)
    path = os.path.join(os.fspath(storage.root), name)
    problem = self.problem(name)
    if problem is None or not os.path.isdir(path):
      return
    if not os.path.isfile(os.path.join(path, names.COMMIT_MARKER)):
      cleaner.remove(storage, name)
      return
    aside = names.broken_name(step, secrets.token_hex(4))
    os.rename(path, os.path.join(os.fspath(storage.root), aside))
    fsync_dir(os.fspath(storage.root))
    logging.warning("ckpt: %s %s; a save of step %d needs its name, so it "
                    "was set aside as %s (nothing deleted; `ckpt gc "
                    "--incomplete --yes` deletes it)", path, problem, step,
                    aside)

  def publish(self, step: int, token: str, index_data: bytes,
              lease_gen: bytes | None) -> None:
    """Writes the index and the marker into the attempt, fsyncs every
    directory of it, renames it to ``checkpoint_<step>/`` and fsyncs the
    root: after a power loss the step is whole or absent."""
    storage = self.storage
    del lease_gen  # the rename fails if the directory was removed
    rel = self.work_dir(step, token)
    final = names.step_dirname(step)
    where = f"{storage.url.rstrip('/')}/{rel}"
    work = os.fspath(storage.root / rel)
    try:
      storage_lib.write_file(os.path.join(work, names.INDEX_NAME),
                             index_data)
      storage_lib.write_file(os.path.join(work, names.COMMIT_MARKER),
                             records.marker(step, token, ""))
    except FileNotFoundError as e:  # renamed away by a cleaner just now
      raise removed_error(step, where, "its directory is gone") from e
    for dirpath, _, _ in os.walk(work, topdown=False):
      fsync_dir(dirpath)  # every entry the checkpoint consists of, durable
    try:
      os.rename(work, storage.root / final)
    except OSError as e:
      if not os.path.isdir(work):
        raise removed_error(step, where, "its directory is gone") from e
      if self.is_committed(step):
        raise committed_elsewhere(storage, step, where) from e
      raise CheckpointError(
          f"cannot commit step {step}: renaming {where} to {final} failed "
          f"({type(e).__name__}: {e}); nothing was committed") from e
    fsync_dir(os.fspath(storage.root))
