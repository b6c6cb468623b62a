"""The barriers and the outcome of a save (ckpt/save/runner.py's stages 5
and 9): how a failure on one process reaches every process.

"written" is a barrier at which a process that failed reports it first;
process 0 reads the reports and relays them, with its own failure (the
commit's), in the outcome, one key every other process reads with one
blocking get (``done``). Each call of each process is one more for the
coordination service process 0 runs (docs/at-scale.md): a later save costs
a process other than 0 two barriers ("start/in" of the save round,
"written") and two blocking gets (the round's decision, the outcome).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Callable, TypeVar

from ckpt.commit import lease as lease_lib
from ckpt.errors import CheckpointError
from ckpt.multihost import process as multihost
from ckpt.save import seat as seat_lib
from ckpt.store import deadline as deadline_lib

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Attempt:
  """One agreed attempt at saving ``step``."""
  step: int
  key: str          # coordination-key prefix (multihost.call_key)
  token: str        # chosen by process 0
  work_dir: str     # relative to the root
  timeout_s: float
  lease_s: float = lease_lib.DEFAULT_LEASE_S
  host_states: int | None = None  # agreed: the index's host_states
  # The barrier (or the outcome key) this process's thread waits at now
  # (ckpt/save/seat.py): a save cancelled there leaves the waiting thread
  # behind, which Checkpointer.cancel releases.
  waiting: seat_lib.BarrierSeat = dataclasses.field(
      default_factory=seat_lib.BarrierSeat, compare=False)


WRITTEN = "all processes wrote their data"
DONE = "the commit finished"
OUTCOME = "done/outcome"  # the key, under the attempt's, of the outcome
# Process 0: the keys of the last committed attempt of each directory,
# left for the others to read its outcome (``forget``).
_unread: dict[str, str] = {}


async def _wait(attempt: Attempt, key: str, fn: Callable[..., T],
                *args) -> T:
  """``fn(*args)`` on a thread: this process waits for the others (at
  barrier ``key``) or for process 0 (for key ``key``). The thread takes
  the attempt's seat right before it calls ``fn`` (a call still queued
  when the save is cancelled never runs, and is not waiting: seat.py);
  a save cancelled while it waits leaves the seat taken, for ``cancel``
  to release the thread. The wait is no stall of the store (the save's
  deadline)."""
  t0 = time.monotonic()
  got = await asyncio.to_thread(attempt.waiting.wait, key, lambda: fn(*args))
  deadline = deadline_lib.current()
  if deadline is not None:
    deadline.exclude(time.monotonic() - t0)
  return got


def _said(error: BaseException) -> str:
  """A failure as reported to the others (a deadline's own error names the
  operation, the bound and its option)."""
  shown = deadline_lib.timeout_in(error) or error
  return f"{type(shown).__name__}: {shown}"


async def barrier(attempt: Attempt, name: str, what: str,
                  error: BaseException | None = None,
                  on_arrival: Callable[[], None] = lambda: None, *,
                  heard: bool = True) -> None:
  """A barrier that also carries failures: a process that failed still
  arrives (after saying so), so the others stop now, not at a timeout.
  ``on_arrival`` runs once every process has arrived, before any failure
  is raised. ``heard`` False: the failures the others reported are not
  read here (process 0 reads them and relays them in the outcome:
  ``run_save``), and this process's own ``error`` is not raised yet."""
  key = f"{attempt.key}/{name}"
  if error is not None:
    multihost.report_failure(f"{key}/failed", _said(error), attempt.timeout_s)
  await _wait(attempt, key, lambda: multihost.barrier(
      key, timeout_s=attempt.timeout_s, what=f"{what}, step {attempt.step}"))
  on_arrival()
  if not heard:
    return
  if error is not None:
    raise error
  reported = multihost.reported_failures(f"{key}/failed", attempt.timeout_s)
  if reported:
    raise failed(attempt, what, reported)


def failed(attempt: Attempt, what: str,
           reported: dict[int, str]) -> CheckpointError:
  """The error of a save that ``reported`` {process: failure} before
  ``what``."""
  return CheckpointError(
      f"saving step {attempt.step} failed on process(es) {sorted(reported)} "
      f"before '{what}'; nothing was committed. "
      + "; ".join(f"process {p}: {m}" for p, m in sorted(reported.items())))


async def done(attempt: Attempt, error: BaseException | None,
               report: bool, relayed: dict[int, str]) -> None:
  """9: process 0 sets the outcome (``<key>/done/outcome``): the failures
  the others reported at "written" (``relayed``), else its own failure
  (unless ``report`` is False), else none. Every other process reads it
  with one blocking get and raises what it says (one that failed itself:
  its own error, once the outcome is there). One call per process,
  where a barrier "done" and a read were two: each is one more for the
  coordination service process 0 runs (docs/at-scale.md). A process 0
  that never sets it (dead, frozen) ends the wait at ``timeout_s``, as
  the barrier did; ``cancel`` sets it for a cancelled save."""
  key = f"{attempt.key}/{OUTCOME}"
  if multihost.process_index() == 0:
    said = ({"relayed": relayed} if relayed else
            {"failed": _said(error)[:4000]} if error is not None and report
            else {})
    await asyncio.to_thread(multihost.announce_value, key, json.dumps(said),
                            attempt.timeout_s, f"{DONE}, step {attempt.step}")
    if error is not None:
      raise error
    return
  got = json.loads(await _wait(
      attempt, key, multihost.wait_for_value, key, attempt.timeout_s,
      f"the outcome of the save of step {attempt.step} from process 0"))
  if error is not None:
    raise error
  if got.get("cancelled"):
    raise CheckpointError(f"the save of step {attempt.step} was cancelled")
  if got.get("relayed"):
    raise failed(attempt, WRITTEN, {int(p): m for p, m in
                                    got["relayed"].items()})
  if got.get("failed"):
    raise failed(attempt, DONE, {0: got["failed"]})


def forget(attempt: Attempt, read: bool) -> None:
  """Process 0, at the end of a save every process said it stopped
  writing: deletes the coordination keys of the directory's previous
  save (every process read its outcome before it joined this save's
  round) and, when ``read`` (a failure: every process passed the barrier
  "removed" or gave up), this save's; else they stay until the next save
  of the directory (the others may not have read the outcome yet)."""
  base = attempt.key.rsplit("/save/", 1)[0]
  previous = _unread.pop(base, None)
  if previous is not None:
    multihost.forget(previous, attempt.timeout_s)
  if read:
    multihost.forget(attempt.key, attempt.timeout_s)
  else:
    _unread[base] = attempt.key
