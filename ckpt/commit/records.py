"""The small documents of the commit protocol (see ckpt/commit/protocol.py).

- Attempt tokens (hex) and the commit marker ``checkpoint_<step>/
  commit_success``: JSON naming the attempt that won and its data
  directory, parsed without trusting the path it names.
- The flat records of object stores: ``commits/<step>`` (the marker's JSON
  plus the step's save time and metrics, padded to ``RECORD_BYTES`` so one
  ranged GET reads it), ``commits/complete``, and ``pending/<step>.<token>``
  per attempt or deletion in progress. Discovery lists these prefixes, never
  the chunks; commit.py's docstring gives the protocol that orders them.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from typing import Any

from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.store import names

TOKEN_RE = re.compile(r"^[0-9a-f]{1,64}$")
ATTEMPT_DIR_RE = re.compile(r"^attempt-([0-9a-f]{1,64})$")
RECORDS = names.RECORDS_DIR + "/"
RECORDS_COMPLETE = RECORDS + "complete"
PENDING = names.PENDING_DIR + "/"
RECORD_BYTES = 4096
STEP_NAME_RE = re.compile(r"^(0|[1-9][0-9]{0,18})$")
PENDING_RE = re.compile(r"^(0|[1-9][0-9]{0,18})\.([0-9a-f]{1,64}|delete)$")
DELETE = "delete"


def check_token(token: str) -> str:
  if not TOKEN_RE.match(token):
    raise CheckpointError(f"invalid attempt token {token!r}: expected hex digits")
  return token


def json_field(storage: storage_lib.Storage, key: str, field: str,
                cast: type) -> Any:
  """``cast(value of field)`` in the small JSON object at ``key``; None if
  the key is missing or does not hold such a field."""
  data = storage.read_bytes(key)
  if data is None:
    return None
  try:
    return cast(json.loads(data)[field])
  except (ValueError, KeyError, TypeError):
    return None


def marker(step: int, token: str, data_dir: str) -> bytes:
  # Not empty: some servers (gcp-storage-emulator) fail on empty objects.
  return (json.dumps({"step": step, "attempt": token, "dir": data_dir})
          + "\n").encode()


def parse_marker(data: bytes, where: str) -> tuple[str | None, str]:
  """(attempt token or None, data directory relative to the step)."""
  try:
    m = json.loads(data)
  except ValueError:
    return None, ""  # ckpt < 0.2: "checkpoint_<step> committed", data beside it
  if not isinstance(m, dict):
    return None, ""
  data_dir = m.get("dir", "")
  if data_dir and not (isinstance(data_dir, str)
                       and ATTEMPT_DIR_RE.match(data_dir)):
    # Never trust a path read from a checkpoint.
    from ckpt.errors import CorruptCheckpointError  # pylint: disable=g-import-not-at-top
    raise CorruptCheckpointError(
        f"{where} names the data directory {data_dir!r}; expected "
        "'attempt-<hex>' or nothing")
  token = m.get("attempt")
  return (str(token) if token is not None else None), data_dir


def marker_attempt(data: bytes | None) -> str | None:
  if data is None:
    return None
  return parse_marker(data, "the commit marker")[0]


def record_key(step: int) -> str:
  return f"{RECORDS}{step}"


def pending_key(step: int, token: str) -> str:
  """The ``pending/`` record of an attempt, or of a deletion (``"delete"``)."""
  return f"{PENDING}{step}.{token if token == DELETE else check_token(token)}"


def record(step: int, token: str | None, data_dir: str,
            time_s: float | None, metrics: dict | None,
            temporary: bool = False) -> bytes:
  doc = {"step": step, "attempt": token, "dir": data_dir, "time": time_s,
         "metrics": metrics}
  if temporary:  # its index says so too (the record repeats it for retention)
    doc["temporary"] = True
  data = (json.dumps(doc, sort_keys=True) + "\n").encode()
  return data + b" " * (RECORD_BYTES - len(data))  # nothing if longer


def check_metrics(m, where: str) -> dict | None:
  if m is None:
    return None
  if not isinstance(m, dict) or not all(
      isinstance(k, str) and type(v) in (int, float) for k, v in m.items()):
    raise CorruptCheckpointError(
        f"{where}: metrics must map names to numbers, got {str(m)[:200]!r}")
  return dict(m)


def read_record(storage: storage_lib.Storage, step: int) -> dict | None:
  """``step``'s commit record (None: no record), checked: ``attempt``,
  ``dir``, ``time`` (None if unknown) and ``metrics`` (None if unknown).
  One GET (a record longer than RECORD_BYTES: three)."""
  key = record_key(step)
  data = storage.read_head(key, RECORD_BYTES)
  if data is None:
    return None
  try:
    json.loads(data)
  except ValueError:
    if len(data) >= RECORD_BYTES:  # longer than the padding: read it whole
      data = storage.read_bytes(key)
      if data is None:
        return None
  return parse_record(data, step, f"{storage.url.rstrip('/')}/{key}")


def parse_record(data: bytes, step: int, where: str) -> dict:
  """``read_record``'s check of the bytes of ``step``'s record."""
  try:
    doc = json.loads(data)
  except ValueError:
    doc = None
  if not isinstance(doc, dict) or doc.get("step") != step:
    raise CorruptCheckpointError(
        f"{where}: not the commit record of step {step} (expected a JSON "
        f"object with \"step\": {step}), got {bytes(data[:200])!r}")
  token, data_dir = parse_marker(
      json.dumps({k: doc.get(k) for k in ("attempt", "dir")}).encode(), where)
  if token is not None and not TOKEN_RE.match(token):
    raise CorruptCheckpointError(f"{where}: invalid attempt {token!r}")
  t = doc.get("time")
  if t is not None and (type(t) not in (int, float) or not math.isfinite(t)):
    raise CorruptCheckpointError(f"{where}: invalid save time {t!r}")
  return {"attempt": token, "dir": data_dir or "",
          "time": None if t is None else float(t),
          "metrics": check_metrics(doc.get("metrics"), where),
          "temporary": doc.get("temporary") is True}


def read_info(storage: storage_lib.Storage, step: int
              ) -> tuple[dict, float | None, bool] | None:
  """(metrics, save time, temporary) of ``step`` from its commit record:
  one GET; None where there is no record holding them (POSIX, a root not
  migrated yet, a record written without them): then the index says."""
  if storage.is_posix or not records_complete(storage):
    return None
  rec = read_record(storage, step)
  if rec is None or rec["metrics"] is None:
    return None
  return rec["metrics"], rec["time"], rec["temporary"]


def records_complete(storage: storage_lib.Storage) -> bool:
  """Whether ``commits/`` lists every committed step of this root (False on
  POSIX). One GET of ``commits/complete`` until it is seen, then cached."""
  if storage.is_posix:
    return False
  if not storage.records_complete and storage.exists(RECORDS_COMPLETE):
    storage.records_complete = True
  return storage.records_complete


def write_pending(storage: storage_lib.Storage, step: int, token: str,
                   time_s: float | None = None,
                   deletes: tuple[str | None, str] | None = None
                   ) -> bytes | None:
  """Writes the ``pending/`` record of an attempt, or (``token`` "delete")
  of a deletion; a deletion's names what it deletes: ``deletes`` is the
  (attempt token or None, data directory) of the commit it removes, data
  directory "" for data beside the marker (ckpt < 0.2, or a step copied
  from a disk). Returns the record's storage generation."""
  doc = {"step": step, "attempt": token,
         "time": time.time() if time_s is None else time_s,
         "host": socket.gethostname(), "pid": os.getpid()}
  if deletes is not None:
    doc["deletes"] = {"attempt": deletes[0], "dir": deletes[1]}
  return storage.write_bytes(pending_key(step, token), json.dumps(doc).encode())


def deletion_target(data: bytes | None) -> tuple[str | None, str] | None:
  """The (attempt token or None, data directory) a deletion's ``pending/``
  record names; None if it names none (written by a ckpt before 0.3, or
  damaged): then whoever finishes it goes by what nobody names."""
  if data is None:
    return None
  try:
    doc = json.loads(data)
    target = doc["deletes"]
    token, data_dir = target["attempt"], target["dir"]
  except (ValueError, KeyError, TypeError):
    return None
  if token is not None and not (isinstance(token, str)
                                and TOKEN_RE.match(token)):
    return None
  if not (data_dir == "" or (isinstance(data_dir, str)
                             and ATTEMPT_DIR_RE.match(data_dir))):
    return None  # never trust a path read from the store
  return token, data_dir


def pending_time(storage: storage_lib.Storage, step: int, token: str
                  ) -> float | None:
  return json_field(storage, pending_key(step, token), "time", float)


def list_pending(storage: storage_lib.Storage) -> list[tuple[int, str]]:
  """(step, attempt token or "delete") of every ``pending/`` record: one
  listing of that prefix."""
  out = []
  for key in storage.list_keys(PENDING):
    m = PENDING_RE.match(key[len(PENDING):])
    if m:
      out.append((int(m.group(1)), m.group(2)))
  return sorted(out)


def commit_state(storage: storage_lib.Storage, step: int
                 ) -> tuple[bool, str | None]:
  """(whether ``step`` is committed, the token of the attempt that
  committed it): one read."""
  if records_complete(storage):
    rec = read_record(storage, step)
    return rec is not None, rec and rec["attempt"]
  data = storage.read_bytes(
      f"{names.step_dirname(step)}/{names.COMMIT_MARKER}")
  return data is not None, marker_attempt(data)
