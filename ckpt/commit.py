"""The commit protocol: how a save becomes a checkpoint, and what may be deleted.

Every save is one *attempt*, named by a token process 0 picks. Its data
goes into a work directory that nothing else writes into:

- POSIX file systems: ``checkpoint_<step>.tmp-<token>/``. The commit is one
  ``rename`` to ``checkpoint_<step>/``, which is atomic.
- Object stores and ``memory://`` (no rename):
  ``checkpoint_<step>/attempt-<token>/``. The commit is the marker
  ``checkpoint_<step>/commit_success``, written last and only if absent,
  naming the attempt; readers go from the marker to the attempt's index. A
  retry's late PUT, or a leftover process of an earlier attempt, can only
  write into its own attempt, never into the one that committed.

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

What cleanup may delete (``abandoned``): attempts whose lease expired. A
live attempt's ``attempt.json`` holds the time of its last heartbeat
(process 0 rewrites it every ``lease_s / 5`` while the save runs); an
attempt is abandoned only when that time is older than ``lease_s`` (default
10 minutes) or the file is missing and the directory itself is that old.
Half-done deletions (``*.tmp-del-*``) are always removable. A committed
step is never "abandoned"; deleting it (retention, ``ckpt gc``) removes the
marker first (buckets) or renames it away (POSIX), so no reader ever sees
half of it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import time
from ckpt import storage as storage_lib
from ckpt.errors import CheckpointError, CheckpointNotFoundError

ATTEMPT_FILE = "attempt.json"
ATTEMPT_PREFIX = "attempt-"
DEFAULT_LEASE_S = 600.0
# TensorStore's generation of a key that does not exist: a write with
# ``if_equal=NO_VALUE`` creates the key only if it is absent.
NO_VALUE = b"\x02"
_TOKEN_RE = re.compile(r"^[0-9a-f]{1,64}$")
_ATTEMPT_DIR_RE = re.compile(r"^attempt-([0-9a-f]{1,64})$")
_DEL_RE = re.compile(r"^checkpoint_\d+\.tmp-del-[0-9a-f]+$")


def _check_token(token: str) -> str:
  if not _TOKEN_RE.match(token):
    raise CheckpointError(f"invalid attempt token {token!r}: expected hex digits")
  return token


def work_dir(storage: storage_lib.Storage, step: int, token: str) -> str:
  """The relative directory the attempt ``token`` at ``step`` writes into."""
  name = storage_lib.step_dirname(step)
  if storage.is_posix:
    return f"{name}.tmp-{_check_token(token)}"
  return f"{name}/{ATTEMPT_PREFIX}{_check_token(token)}"


def _lease(token: str) -> bytes:
  return json.dumps({"token": token, "time": time.time(),
                     "host": socket.gethostname(), "pid": os.getpid()}).encode()


def fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


# ---- an attempt's life ------------------------------------------------------

def prepare(storage: storage_lib.Storage, step: int, token: str) -> str:
  """Process 0, before anyone writes: a fresh work directory holding only
  ``attempt.json``. Returns its relative path."""
  rel = work_dir(storage, step, token)
  if storage.is_posix:
    storage.root.mkdir(parents=True, exist_ok=True)
    # An uncommitted checkpoint_<step>/ (no marker: a partial copy, say)
    # would make the commit rename fail on every try; drop it.
    final = storage.root / storage_lib.step_dirname(step)
    if final.is_dir() and not is_committed(storage, step):
      remove(storage, storage_lib.step_dirname(step))
    os.mkdir(storage.root / rel)  # fails if it exists: tokens are fresh
    storage_lib.write_file(os.fspath(storage.root / rel / ATTEMPT_FILE), _lease(token))
  else:
    storage.write_bytes(f"{rel}/{ATTEMPT_FILE}", _lease(token))
  return rel


def heartbeat(storage: storage_lib.Storage, step: int, token: str) -> None:
  """Process 0, while the save runs: renews the attempt's lease (only if
  its directory still exists)."""
  rel = work_dir(storage, step, token)
  if storage.is_posix:
    storage_lib.write_file(os.fspath(storage.root / rel / ATTEMPT_FILE), _lease(token))
  else:
    storage.write_bytes(f"{rel}/{ATTEMPT_FILE}", _lease(token))


def _attempt_token(storage: storage_lib.Storage, rel: str) -> str | None:
  data = storage.read_bytes(f"{rel}/{ATTEMPT_FILE}")
  if data is None:
    return None
  try:
    return str(json.loads(data)["token"])
  except (ValueError, KeyError, TypeError):
    return None


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
                    _marker(step, token, ""))
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
  with storage.store_errors(f"writing the commit marker of step {step} to"):
    storage.kv.write(marker_key, _marker(step, token, rel.split("/", 1)[1]),
                     if_equal=NO_VALUE).result()
  # A write whose condition failed is not an error in TensorStore; a retried
  # PUT of ours may also find our own marker. Read which attempt won.
  if _marker_attempt(storage.read_bytes(marker_key)) != token:
    raise CheckpointError(
        f"cannot commit step {step} in {storage.url!r}: another attempt "
        f"committed it first; this attempt ({where}) was not committed")


def _marker(step: int, token: str, data_dir: str) -> bytes:
  # Not empty: some servers (gcp-storage-emulator) fail on empty objects.
  return (json.dumps({"step": step, "attempt": token, "dir": data_dir})
          + "\n").encode()


def _parse_marker(data: bytes, where: str) -> tuple[str | None, str]:
  """(attempt token or None, data directory relative to the step)."""
  try:
    m = json.loads(data)
  except ValueError:
    return None, ""  # ckpt < 0.2: "checkpoint_<step> committed", data beside it
  if not isinstance(m, dict):
    return None, ""
  data_dir = m.get("dir", "")
  if data_dir and not (isinstance(data_dir, str)
                       and _ATTEMPT_DIR_RE.match(data_dir)):
    # Never trust a path read from a checkpoint.
    from ckpt.errors import CorruptCheckpointError  # pylint: disable=g-import-not-at-top
    raise CorruptCheckpointError(
        f"{where} names the data directory {data_dir!r}; expected "
        "'attempt-<hex>' or nothing")
  token = m.get("attempt")
  return (str(token) if token is not None else None), data_dir


def _marker_attempt(data: bytes | None) -> str | None:
  if data is None:
    return None
  return _parse_marker(data, "the commit marker")[0]


# ---- discovery --------------------------------------------------------------

def is_committed(storage: storage_lib.Storage, step: int) -> bool:
  name = storage_lib.step_dirname(step)
  if storage.is_posix:
    return (storage.root / name / storage_lib.COMMIT_MARKER).exists()
  return storage.read_bytes(f"{name}/{storage_lib.COMMIT_MARKER}") is not None


def step_dir(storage: storage_lib.Storage, step: int) -> str:
  """The relative directory holding ``step``'s index and data."""
  name = storage_lib.step_dirname(step)
  key = f"{name}/{storage_lib.COMMIT_MARKER}"
  data = storage.read_bytes(key)
  if data is None:
    raise CheckpointNotFoundError(
        f"step {step} is not committed in {storage.url!r} (no {key})")
  _, data_dir = _parse_marker(data, f"{storage.url.rstrip('/')}/{key}")
  return f"{name}/{data_dir}" if data_dir else name


def committed_attempt(storage: storage_lib.Storage, step: int) -> str | None:
  """The token of the attempt that committed ``step`` (None: not committed,
  or committed by a ckpt that did not record it)."""
  return _marker_attempt(storage.read_bytes(
      f"{storage_lib.step_dirname(step)}/{storage_lib.COMMIT_MARKER}"))


def own_step_dir(storage: storage_lib.Storage) -> str | None:
  """When the storage URL is itself one step's directory: its data
  directory ("" or "attempt-<token>"); else None."""
  data = storage.read_bytes(storage_lib.COMMIT_MARKER)
  if data is not None:
    return _parse_marker(data, f"{storage.url.rstrip('/')}/"
                         f"{storage_lib.COMMIT_MARKER}")[1]
  if storage.read_bytes(storage_lib.INDEX_NAME) is not None:
    return ""  # a step directory copied without its marker
  # A bucket's step directory copied without its marker: the one attempt
  # that holds an index, if there is exactly one.
  if storage.is_posix:
    if not storage.root.is_dir():
      return None
    found = sorted(p.name for p in storage.root.iterdir()
                   if _ATTEMPT_DIR_RE.match(p.name)
                   and (p / storage_lib.INDEX_NAME).exists())
  else:
    found = sorted({k.split("/")[0] for k in storage.list_keys(ATTEMPT_PREFIX)
                    if k.endswith("/" + storage_lib.INDEX_NAME)
                    and _ATTEMPT_DIR_RE.match(k.split("/")[0])
                    and k.count("/") == 1})
  if len(found) > 1:
    raise CheckpointError(
        f"{storage.url!r} has no commit marker and {len(found)} attempts "
        f"with an index ({found}); name the one to read "
        f"({storage.url.rstrip('/')}/{found[0]})")
  return found[0] if found else None


def committed_steps(storage: storage_lib.Storage) -> list[int]:
  if storage.is_posix:
    if not storage.root.exists():
      return []
    steps = [storage_lib.parse_step(p.name) for p in storage.root.iterdir()]
    return sorted(s for s in steps if s is not None and is_committed(storage, s))
  return sorted(_scan(storage)[0])


def _scan(storage: storage_lib.Storage):
  """From ONE listing of a bucket: (committed steps, {step: attempt tokens},
  steps holding keys outside any attempt)."""
  committed, attempts, loose = set(), {}, set()
  for key in storage.list_keys(storage_lib.STEP_PREFIX):
    head, _, tail = key.partition("/")
    s = storage_lib.parse_step(head)
    if s is None or not tail:
      continue
    first, _, rest = tail.partition("/")
    m = _ATTEMPT_DIR_RE.match(first)
    if tail == storage_lib.COMMIT_MARKER:
      committed.add(s)
    elif m and rest:
      attempts.setdefault(s, set()).add(m.group(1))
    else:
      loose.add(s)
  return committed, attempts, loose


def _age_s(storage: storage_lib.Storage, rel: str) -> float | None:
  """Seconds since the attempt's last heartbeat (None: unknown)."""
  data = storage.read_bytes(f"{rel}/{ATTEMPT_FILE}")
  if data is not None:
    try:
      return time.time() - float(json.loads(data)["time"])
    except (ValueError, KeyError, TypeError):
      pass
  if storage.is_posix:
    try:
      return time.time() - os.stat(storage.root / rel).st_mtime
    except OSError:
      return None
  return None


def abandoned(storage: storage_lib.Storage, lease_s: float = DEFAULT_LEASE_S
              ) -> list[str]:
  """Relative directories of attempts that are provably abandoned."""
  out = []
  if storage.is_posix:
    if not storage.root.exists():
      return []
    for p in sorted(storage.root.iterdir()):
      if _DEL_RE.match(p.name):
        out.append(p.name)
      elif storage_lib.is_tmp_name(p.name):
        age = _age_s(storage, p.name)
        if age is not None and age >= lease_s:
          out.append(p.name)
    return out
  committed, attempts, loose = _scan(storage)
  for s, tokens in sorted(attempts.items()):
    winner = committed_attempt(storage, s) if s in committed else None
    for t in sorted(tokens - {winner}):
      rel = work_dir(storage, s, t)
      age = _age_s(storage, rel)
      # A committed step's losing attempts go once their lease is over too.
      if age is None or age >= lease_s:
        out.append(rel)
  # Keys of an uncommitted step outside any attempt: a save by ckpt < 0.2
  # that never committed (today's saves write only inside attempts).
  out += [storage_lib.step_dirname(s) for s in sorted(loose - committed)
          if s not in attempts]
  return out


# ---- deletion ---------------------------------------------------------------

def remove(storage: storage_lib.Storage, rel: str) -> None:
  """Deletes a step, an attempt or a leftover directory; a committed step
  stops being visible first, so it is never seen half-deleted."""
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
      if not _DEL_RE.match(rel):
        # One atomic rename first: a committed step vanishes at once, and a
        # save still writing into an attempt can no longer commit it.
        head = rel.split(".", 1)[0]
        doomed = storage.root / f"{head}.tmp-del-{secrets.token_hex(4)}"
        os.rename(path, doomed)
        path = doomed
      shutil.rmtree(path, ignore_errors=True)
    return
  if step is not None:  # a whole step: the marker first
    with storage.store_errors(f"deleting the commit marker of step {step} from"):
      storage.kv.write(f"{rel}/{storage_lib.COMMIT_MARKER}", None).result()
  storage.delete_prefix(f"{rel}/", what)


def remove_attempt(storage: storage_lib.Storage, step: int, token: str) -> None:
  """Deletes one attempt that did not commit (never a committed step)."""
  if committed_attempt(storage, step) == token and not storage.is_posix:
    return  # it did commit after all: it is the step now
  remove(storage, work_dir(storage, step, token))


def guard(storage: storage_lib.Storage, step: int):
  """A check that ``step`` is still the one committed now (the attempt its
  marker names has not changed), for lazy leaves: they read only the data
  they were made from, or raise."""
  token = committed_attempt(storage, step)

  def check() -> None:
    if not is_committed(storage, step):
      what = "deleted"
    elif committed_attempt(storage, step) != token:
      what = "deleted and saved again"
    else:
      return
    raise CheckpointError(
        f"step {step} in {storage.url!r} was {what} after this lazy leaf was "
        "created (by retention or another job): the leaf's data is gone, and "
        "ckpt never reads other data in its place. Restore again from a "
        "step that exists")
  return check
