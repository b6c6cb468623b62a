"""The commit of a save that no trainer takes part in: an agreement through
the storage itself, for ``Checkpointer(..., writer="process")``.

Today's commit (ckpt/save/runner.py) goes through ``jax.distributed``
barriers, whose service lives in process 0's trainer: a trainer that dies
takes the save in flight with it. Here each host's writer process says
what it wrote in a small file of the attempt, and process 0's writer
commits once all of them are there; no coordination service, no clock
compared across hosts.

The API (what a writer process calls; nothing else of ckpt is needed)::

  hold_lease(storage, step, token, lease_s=DEFAULT_LEASE_S) -> Renewal
      process 0's writer, as soon as it takes the attempt over: renews the
      attempt's lease (attempt.json) now and every lease_s/6 from this
      process (the trainer does not renew it), so cleanup sees a live
      holder while the writer lives, whatever became of the trainer.

  write_record(storage, step, token, process, processes, *,
               files=None, tiling=None, error=None) -> None
      every writer, once its part of the attempt is durable (its arrays
      written and synced, its per-process files written): the record
      ``<attempt>/.writers/<process>.msgpack``. ``files``: {relative path
      in the attempt: the bytes written} of this process's small files
      (index.process_file: its host_state, checksums, reuse files), whose
      crc32c the record keeps; ``tiling``: the digest of the boxes it wrote
      (ckpt/shards/tiling.py ``digest``). A writer that failed writes its
      record with ``error`` (a sentence): then nothing is committed.

  commit_when_written(storage, step, token, processes, index, *, bound_s,
                      renewal=None, whole=None, stop=None,
                      clock=time.monotonic) -> None
      process 0's writer: waits (polling with backoff, on this process's
      monotonic clock) for the ``processes`` records of this attempt, at
      most ``bound_s`` seconds; checks each (sealed, this step, this
      attempt, this process, this job size; every file it names present
      with its crc32c), the tiling against ``whole`` (the digest of every
      array once, ``tiling.whole``) if given, then writes the index
      (``index``: its bytes, or a callable making them once all records are
      in) and commits as ckpt/commit/protocol.py ``commit`` does, stopping
      ``renewal`` (its last renewal proves the attempt is still this one).
      Raises WriterFailedError (a record says a writer failed, or a record
      or a file it names is damaged or missing: nothing committed),
      BarrierTimeoutError (the bound passed with records missing: nothing
      committed), or the commit's own errors (removed attempt, step
      committed by another attempt); the wait ends at once when the
      attempt's lease is gone (removed: it can never commit). ``bound_s``
      bounds the wait between looks; one look that hangs on a store that
      stopped answering is bounded by the caller's stall deadline
      (ckpt/store/deadline.py): run this under the save's one
      (``deadline.scope``, ``save_timeout_s``), as the trainer's commit is. ``stop`` (a threading.Event): set, the
      wait ends with a CheckpointError and nothing is committed.

  wait_committed(storage, step, token, bound_s, *, stop=None,
                 clock=time.monotonic) -> bool
      any process (another host's writer, a trainer): whether this attempt
      committed ``step`` within ``bound_s``; False as soon as the attempt
      is gone without committing, or its lease's holder is provably dead
      (it ran on this host: ckpt/commit/lease.py ``dead_reason``).

  recorded(storage, step, token, process, processes) -> bool | None
      what the record of ``process`` says: True (its part is durable),
      False (failed, or damaged), None (none of this attempt yet). A
      trainer whose writer died reads it: True, the step may still commit
      (``wait_committed``); None, it writes the failed record itself.

  never_commits(storage, step, token) -> bool
      whether that attempt can no longer commit ``step`` (another attempt
      did, it is gone, or its holder is provably dead): a False of
      ``wait_committed`` before its bound, told apart from a bound passed. The storage is the truth: False after
      the bound means "not seen committed", so give it a bound longer than
      process 0's (its ``bound_s`` plus the commit's own, e.g.
      ``save_timeout_s``), or a process 0 that froze and woke up in time
      may commit after another process said it did not.

Guarantees (the commit protocol's, ckpt/commit/protocol.py):

- Nothing partial is visible: the commit is the protocol's own (rename on
  a disk; marker then record on a bucket) and runs only once every record
  is in; a writer killed at any point leaves the step uncommitted, and the
  next save's cleanup removes the attempt once its lease is over.
- A removed or superseded attempt never commits: the records are read
  from this attempt's own directory, each names the step and the attempt
  it belongs to (a record of another attempt, e.g. a leftover copied or
  written late, is never counted), and the commit re-checks the lease as
  this writer last renewed it (a cleaner removes the lease first), and on
  a bucket the attempt's ``pending/`` record, right before and after it
  makes the step visible.
- A damaged record (its crc32c trailer, its fields), or a file it names
  that is missing or damaged, means no commit.
- Bounds are one process's ``time.monotonic`` only.

Retention is not run here: the trainer's Checkpointer runs its policy
after its next commit, and that pass counts every committed step, this
one included (retention needs the policy and the steps being restored,
which live in the trainer). A failure found while all records are in
(every writer stopped writing) removes the attempt at once; otherwise
(missing records, the bound) the attempt stays for the cleanup of a later
save, as today's commit leaves a save whose processes did not all stop.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Mapping, Sequence

from absl import logging
import crc32c
import msgpack

from ckpt.commit import cleanup as cleanup_lib
from ckpt.commit import lease as lease_lib
from ckpt.commit import protocol as commit_lib
from ckpt.commit import records
from ckpt.commit import renewal as renewal_lib
from ckpt.commit import strategy
from ckpt.commit import attempt as attempt_lib
from ckpt.commit.attempt import ATTEMPT_FILE
from ckpt.errors import BarrierTimeoutError, CheckpointError
from ckpt.format import index as index_lib
from ckpt.format import seal
from ckpt.shards import tiling as tiling_lib
from ckpt.store import storage as storage_lib

# Polling: the first wait between two looks, growing by BACKOFF to at most
# POLL_MAX_S (a look on a bucket is one LIST and a GET per new record).
POLL_FIRST_S = 0.02
POLL_MAX_S = 1.0
BACKOFF = 1.5
# A record is a few hundred bytes; refused beyond this before it is read.
MAX_RECORD_BYTES = 1 << 20
_FILE_KINDS = (index_lib.HOST_STATE_DIR, index_lib.CHECKSUMS_DIR,
               index_lib.REUSE_DIR)


class WriterFailedError(CheckpointError):
  """A writer's record says it failed, or a record (or a file it names) is
  damaged or missing: the step was not committed."""


# ---- the records ------------------------------------------------------------

def record_key(work_dir: str, process: int) -> str:
  """The record of ``process`` in the attempt ``work_dir``."""
  return f"{work_dir}/{index_lib.process_file(index_lib.WRITERS_DIR, process)}"


def hold_lease(storage: storage_lib.Storage, step: int, token: str,
               lease_s: float = lease_lib.DEFAULT_LEASE_S
               ) -> renewal_lib.Renewal:
  """Process 0's writer takes the attempt's lease over (module docstring):
  one renewal now (the removed_error if the attempt is gone), then every
  ``lease_s / 6`` on a thread until ``commit_when_written`` (or ``stop``)."""
  return renewal_lib.Renewal(storage, step, token, lease_s).take().start()


def write_record(storage: storage_lib.Storage, step: int, token: str,
                 process: int, processes: int, *,
                 files: Mapping[str, bytes] | None = None,
                 tiling: Sequence[int] | None = None,
                 error: str | None = None) -> None:
  """This writer's record (module docstring): written last, once what it
  names is durable. Never recreates a removed attempt's lease."""
  _check_job(process, processes)
  records.check_token(token)
  sums = {}
  for rel, data in (files or {}).items():
    if not _is_process_file(rel, process):
      raise ValueError(f"files: {rel!r} is not a per-process file of "
                       f"process {process}; expected one of "
                       f"{_process_files(process)}")
    sums[rel] = crc32c.crc32c(data)
  doc = {"step": step, "attempt": token, "process": process,
         "processes": processes, "ok": error is None,
         "error": None if error is None else str(error)[:4000],
         "files": sums,
         "tiling": None if tiling is None else [int(x) for x in tiling]}
  kind = strategy.for_storage(storage)
  work_dir = kind.work_dir(step, token)
  kind.write_into_attempt(
      work_dir, index_lib.process_file(index_lib.WRITERS_DIR, process),
      seal.seal(msgpack.packb(doc, use_bin_type=True)),
      f"the writer record of process {process}, step {step},")


def recorded(storage: storage_lib.Storage, step: int, token: str,
             process: int, processes: int) -> bool | None:
  """What the record of ``process`` in this attempt says: True (its part
  is durable), False (it failed, or the record is damaged), None (no
  record of this attempt: its writer never got that far)."""
  work_dir = strategy.for_storage(storage).work_dir(step, token)
  key = record_key(work_dir, process)
  data = storage.read_bytes(key, limit=MAX_RECORD_BYTES)
  if data is None:
    return None
  try:
    doc = _Record.parse(data, step, token, process, processes,
                        f"{storage.url.rstrip('/')}/{key}")
  except WriterFailedError:
    return False
  return None if doc is None else doc["ok"]


def _check_job(process: int, processes: int) -> None:
  if type(processes) is not int or not 0 < processes <= index_lib.MAX_PROCESSES:
    raise ValueError(f"processes must be an int in [1, "
                     f"{index_lib.MAX_PROCESSES}], got {processes!r}")
  if type(process) is not int or not 0 <= process < processes:
    raise ValueError(f"process must be an int in [0, {processes}), got "
                     f"{process!r}")


def _process_files(process: int) -> list[str]:
  return [index_lib.process_file(k, process) for k in _FILE_KINDS]


def _is_process_file(rel, process: int) -> bool:
  """Only ``<kind>/<process>.msgpack`` of a known kind: a path read from
  the store is never trusted."""
  return isinstance(rel, str) and rel in _process_files(process)


class _Record:
  """One record as read: counted, not this attempt's (None), or damaged
  (raises)."""

  @staticmethod
  def parse(data: bytes, step: int, token: str, process: int,
            processes: int, where: str) -> dict | None:
    """The record's fields if it is this attempt's; None if it belongs to
    another attempt or step; WriterFailedError if damaged."""
    try:
      body = seal.unseal(data, where)
      doc = msgpack.unpackb(body, raw=False)
    except Exception as e:  # pylint: disable=broad-except
      raise WriterFailedError(
          f"{where}: the record of writer {process} is damaged ({e}); "
          f"nothing was committed") from e
    if not isinstance(doc, dict):
      raise WriterFailedError(f"{where}: expected a map, found "
                              f"{type(doc).__name__}; nothing was committed")
    if doc.get("step") != step or doc.get("attempt") != token:
      return None  # another attempt's: never counted
    for field, want in (("process", process), ("processes", processes)):
      if doc.get(field) != want:
        raise WriterFailedError(
            f"{where}: its {field} is {doc.get(field)!r}, expected {want} "
            "(writers of different job sizes, or a damaged record); nothing "
            "was committed")
    files, tiling = doc.get("files"), doc.get("tiling")
    if (type(doc.get("ok")) is not bool or not isinstance(files, dict)
        or not all(type(v) is int for v in files.values())
        or not (tiling is None or (isinstance(tiling, list) and len(tiling) == 3
                                   and all(type(x) is int for x in tiling)))):
      raise WriterFailedError(
          f"{where}: expected ok (bool), files (path: crc32c) and tiling "
          f"(3 ints or nil); found {str(doc)[:300]}; nothing was committed")
    for rel in files:
      if not _is_process_file(rel, process):
        raise WriterFailedError(
            f"{where} names the file {str(rel)[:200]!r}; expected one of "
            f"{_process_files(process)}; nothing was committed")
    return doc


def _listed(storage: storage_lib.Storage, work_dir: str) -> set[int]:
  """The process numbers whose record file is there now (one listing)."""
  prefix = f"{work_dir}/{index_lib.WRITERS_DIR}/"
  if storage.is_posix:
    try:
      found = os.listdir(os.path.join(os.fspath(storage.root), prefix))
    except OSError:
      return set()
  else:
    found = [k[len(prefix):] for k in storage.list_keys(prefix)]
  out = set()
  for name in found:
    head, _, ext = name.partition(".")
    if ext == "msgpack" and head.isdigit() and str(int(head)) == head:
      out.add(int(head))
  return out


# ---- process 0's writer: wait, check, commit ---------------------------------

class _Wait:
  """A bounded wait with backoff on this process's monotonic clock."""

  def __init__(self, bound_s: float, stop: threading.Event | None,
               clock: Callable[[], float]):
    self.clock, self.stop = clock, stop or threading.Event()
    self.deadline = clock() + bound_s
    self.delay = POLL_FIRST_S

  def left(self) -> float:
    return self.deadline - self.clock()

  def pause(self) -> None:
    """Sleeps until the next look (never past the bound); raises if
    ``stop`` is set."""
    self.stop.wait(max(0.0, min(self.delay, self.left())))
    self.delay = min(self.delay * BACKOFF, POLL_MAX_S)
    if self.stop.is_set():
      raise CheckpointError("the wait for the writers' records was "
                            "stopped; nothing was committed")


def _collect(storage, step: int, token: str, processes: int, wait: _Wait,
             bound_s: float) -> dict[int, dict]:
  """Every process's record of this attempt, or raises (module docstring)."""
  work_dir = strategy.for_storage(storage).work_dir(step, token)
  base = storage.url.rstrip("/")
  lease = f"{work_dir}/{ATTEMPT_FILE}"
  got: dict[int, dict] = {}
  while True:
    for p in sorted(_listed(storage, work_dir) - set(got)):
      if p >= processes:
        continue
      key = record_key(work_dir, p)
      data = storage.read_bytes(key, limit=MAX_RECORD_BYTES)
      if data is None:
        continue
      doc = _Record.parse(data, step, token, p, processes, f"{base}/{key}")
      if doc is not None:
        got[p] = doc
    failed = {p: d["error"] for p, d in got.items() if not d["ok"]}
    if failed:
      raise WriterFailedError(
          f"saving step {step} failed on the writer(s) of process(es) "
          f"{sorted(failed)}; nothing was committed. "
          + "; ".join(f"process {p}: {m}" for p, m in sorted(failed.items())))
    if len(got) == processes:
      return got
    if not storage.exists(lease):  # removed: it can never commit
      raise attempt_lib.removed_error(
          step, f"{base}/{work_dir}", "its lease is gone")
    if wait.left() <= 0:
      raise BarrierTimeoutError(
          f"step {step} was not committed: after {bound_s:g} s the records "
          f"of the writers of process(es) {_some(set(range(processes)) - set(got))} "
          f"were not in {base}/{work_dir}/{index_lib.WRITERS_DIR}/ (a writer "
          "that died or stalls); the attempt is left for the cleanup of a "
          "later save")
    wait.pause()


def _some(ps: set[int]) -> str:
  ps = sorted(ps)
  return str(ps) if len(ps) <= 10 else f"{ps[:10]} and {len(ps) - 10} more"


def _check_files(storage, work_dir: str, got: dict[int, dict]) -> None:
  """Every file a record names is there, with the crc32c it names."""
  base = storage.url.rstrip("/")
  for p, doc in sorted(got.items()):
    for rel, want in sorted(doc["files"].items()):
      key = f"{work_dir}/{rel}"
      data = storage.read_bytes(key, limit=index_lib.MAX_PROCESS_FILE_BYTES)
      got = None if data is None else crc32c.crc32c(data)
      if got != want:
        found = "missing" if got is None else f"crc32c {got:#010x}"
        raise WriterFailedError(
            f"{base}/{key}: the writer of process {p} recorded crc32c "
            f"{want:#010x}, found {found}; nothing was committed")


def _check_tiling(got: dict[int, dict], whole, step: int) -> None:
  parts = [d["tiling"] for _, d in sorted(got.items())]
  if any(t is None for t in parts):
    missing = sorted(p for p, d in got.items() if d["tiling"] is None)
    raise WriterFailedError(
        f"saving step {step}: the records of process(es) {missing} give no "
        "tiling digest, and the commit checks every array was written "
        "exactly once; nothing was committed")
  combined = tiling_lib.combine(parts)
  if tuple(combined) != tuple(whole):
    raise WriterFailedError(
        f"saving step {step}: the boxes the {len(parts)} writers wrote do "
        "not cover every array exactly once (a part written by no process, "
        f"or twice); nothing was committed (digest {list(combined)}, "
        f"expected {list(whole)})")


def commit_when_written(storage: storage_lib.Storage, step: int, token: str,
                        processes: int, index: bytes | Callable[[], bytes],
                        *, bound_s: float,
                        renewal: renewal_lib.Renewal | None = None,
                        whole: Sequence[int] | None = None,
                        stop: threading.Event | None = None,
                        clock: Callable[[], float] = time.monotonic) -> None:
  """Process 0's writer: commits ``step`` once every writer's record of
  this attempt is in (module docstring). ``renewal`` is stopped here."""
  _check_job(0, processes)
  wait = _Wait(bound_s, stop, clock)
  kind = strategy.for_storage(storage)
  work_dir = kind.work_dir(step, token)
  try:
    got = _collect(storage, step, token, processes, wait, bound_s)
    _check_files(storage, work_dir, got)
    if whole is not None:
      _check_tiling(got, whole, step)
    data = index() if callable(index) else index
  except WriterFailedError as e:
    if renewal is not None:
      renewal.stop()
    if _all_records_in(storage, work_dir, processes):
      _remove(storage, step, token, e)  # every writer stopped writing
    raise
  except BaseException:
    if renewal is not None:
      renewal.stop()
    raise
  # The commit re-checks the attempt is still this one (its lease as
  # ``renewal`` last wrote it; without one, the token it names; on a
  # bucket its pending/ record), before and after it makes the step
  # visible.
  commit_lib.commit(storage, step, token, data, renewal)


def _all_records_in(storage, work_dir: str, processes: int) -> bool:
  try:
    return _listed(storage, work_dir) >= set(range(processes))
  except CheckpointError:
    return False


def _remove(storage, step: int, token: str, why: Exception) -> None:
  try:
    cleanup_lib.remove_attempt(storage, step, token)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("ckpt: could not remove the failed attempt %s of step "
                    "%d in %s (%s): %s", token, step, storage.url, why, e)


# ---- any process: did it commit? --------------------------------------------

def wait_committed(storage: storage_lib.Storage, step: int, token: str,
                   bound_s: float, *, stop: threading.Event | None = None,
                   clock: Callable[[], float] = time.monotonic) -> bool:
  """Whether the attempt ``token`` committed ``step`` within ``bound_s``
  (False at once when the attempt is gone and did not commit it, or when
  its holder is provably dead)."""
  kind = strategy.for_storage(storage)
  lease_key = f"{kind.work_dir(step, token)}/{ATTEMPT_FILE}"
  wait = _Wait(bound_s, stop, clock)
  while True:
    committed, by = records.commit_state(storage, step)
    if committed:
      return by == token
    data, _ = kind.read_lease(lease_key)
    if data is None or _holder_dead(data):
      # Gone: committed just now (a rename moves the lease), or removed;
      # or its holder died on this host: nobody commits it any more.
      committed, by = records.commit_state(storage, step)
      return committed and by == token
    if wait.left() <= 0:
      return False
    wait.pause()


def never_commits(storage: storage_lib.Storage, step: int,
                  token: str) -> bool:
  """Whether the attempt ``token`` of ``step`` can no longer commit it:
  another attempt committed the step, or the attempt is gone without
  committing it, or its lease's holder is provably dead (this host)."""
  kind = strategy.for_storage(storage)
  committed, by = records.commit_state(storage, step)
  if committed:
    return by != token
  data, _ = kind.read_lease(f"{kind.work_dir(step, token)}/{ATTEMPT_FILE}")
  if data is not None and not _holder_dead(data):
    return False
  committed, by = records.commit_state(storage, step)  # (a rename just now)
  return not (committed and by == token)


def _holder_dead(lease_data: bytes) -> bool:
  """Whether the lease's holder (process 0's writer, or its trainer before
  the writer took the lease over: a save never handed over whole, which
  no writer commits) ran on this host and is gone."""
  lease = lease_lib.parse(lease_data)
  return lease is not None and lease_lib.dead_reason(lease) is not None
