"""The names ckpt gives what it stores under a checkpoint root: step directories
(``checkpoint_<step>``), attempts and deletions in progress (``.tmp-``, ``attempt-``), set-aside
steps (``.broken-``), the index and the commit marker, the flat prefixes of commit records; which
relative directories ckpt may ever delete; and how an error names a key or a listing.
"""

from __future__ import annotations

import re

STEP_PREFIX = "checkpoint_"
INDEX_NAME = "index.msgpack"
COMMIT_MARKER = "commit_success"
_STEP_RE = re.compile(r"^checkpoint_(\d+)$")
_TMP_RE = re.compile(r"^checkpoint_(\d+)\.tmp-[0-9a-z\-]+$")
_ATTEMPT_REL_RE = re.compile(r"^checkpoint_(\d+)/attempt-[0-9a-f]{1,64}$")
# POSIX: a step directory that lost its index, set aside by a save of that
# step (ckpt/commit/protocol.py); only ``ckpt gc --incomplete`` deletes it.
_BROKEN_RE = re.compile(r"^checkpoint_(\d+)\.broken-[0-9a-f]+$")


def step_dirname(step: int) -> str:
  return f"{STEP_PREFIX}{step}"


def parse_step(name: str) -> int | None:
  m = _STEP_RE.match(name)
  return int(m.group(1)) if m else None


def is_tmp_name(name: str) -> bool:
  """``checkpoint_<step>.tmp-<id>``: an attempt (POSIX) or a deletion."""
  return bool(_TMP_RE.match(name))


def is_deletable(rel: str) -> bool:
  """The only relative directories ckpt ever deletes."""
  return bool(_STEP_RE.match(rel) or _TMP_RE.match(rel)
              or _ATTEMPT_REL_RE.match(rel) or _BROKEN_RE.match(rel))


def broken_name(step: int, tag: str) -> str:
  """Where a save of ``step`` sets aside a ``checkpoint_<step>/`` that lost
  its index (POSIX)."""
  return f"{step_dirname(step)}.broken-{tag}"


def parse_broken(name: str) -> int | None:
  """The step of a set-aside ``checkpoint_<step>.broken-<id>`` (else None)."""
  m = _BROKEN_RE.match(name)
  return int(m.group(1)) if m else None


_KEY_NAMES = {INDEX_NAME: "the index", COMMIT_MARKER: "the commit marker",
              "attempt.json": "the lease"}
# The flat prefixes of ckpt/commit/protocol.py (object stores): one key per committed
# step, one per save or deletion in progress.
RECORDS_DIR = "commits"
PENDING_DIR = "pending"


def describe(rel: str) -> str:
  """How an error names the key ``rel``: "the index of step 5", ..."""
  head, _, tail = rel.partition("/")
  if head == RECORDS_DIR and tail:
    return (f"the commit record of step {tail}" if tail.isdigit() else
            f"{rel} (the commit records)")
  if head == PENDING_DIR and tail:
    return f"{rel} (a save or deletion in progress)"
  if tail.startswith("attempt-") and "/" in tail:  # an attempt on a bucket
    attempt, _, tail = tail.partition("/")
    head = f"{head}/{attempt}"
    m = _STEP_RE.match(rel.partition("/")[0])
    return (f"{_KEY_NAMES.get(tail, repr(tail))} of step {m.group(1)} (in "
            f"{head}/)") if m else repr(rel)
  m = _STEP_RE.match(head) or _TMP_RE.match(head)
  if not m or not tail:
    return _KEY_NAMES.get(rel, repr(rel))
  where = f" (in {head}/)" if _TMP_RE.match(head) else ""
  return f"{_KEY_NAMES.get(tail, repr(tail))} of step {m.group(1)}{where}"


def describe_listing(prefix: str) -> str:
  """How an error names a listing of ``prefix``: "listing the steps of"."""
  if prefix == STEP_PREFIX:
    return "listing the steps of"
  if prefix == RECORDS_DIR + "/":
    return "listing the steps of"  # their commit records
  if prefix == PENDING_DIR + "/":
    return "listing the saves and deletions in progress in"
  head, _, tail = prefix.partition("/")
  m = _STEP_RE.match(head) or _TMP_RE.match(head)
  if m and not tail:
    return f"listing the keys of step {m.group(1)} ({head}/) in"
  return f"listing the keys under {prefix!r} in"
