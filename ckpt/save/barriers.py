"""The barriers of a save (ckpt/save/runner.py) and the attempt they belong
to: each barrier carries failures (a process that failed still arrives,
after saying so, so the others stop now, not at a timeout); process 0
relays what it read at "written" for the others to read after "done". The
barrier a save's thread is in is its attempt's seat (ckpt/save/seat.py),
which ``Checkpointer.cancel`` reads to release it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable

from ckpt.commit import lease as lease_lib
from ckpt.errors import CheckpointError
from ckpt.multihost import process as multihost
from ckpt.save import seat as seat_lib
from ckpt.store import deadline as deadline_lib


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
  # The barrier this process's thread is in now (ckpt/save/seat.py): a
  # save cancelled there leaves the waiting thread behind, which
  # Checkpointer.cancel releases by having the other processes arrive.
  waiting: seat_lib.BarrierSeat = dataclasses.field(
      default_factory=seat_lib.BarrierSeat, compare=False)


WRITTEN = "all processes wrote their data"
DONE = "the commit finished"


async def barrier(attempt: Attempt, name: str, what: str,
                   error: BaseException | None = None,
                   on_arrival: Callable[[], None] = lambda: None, *,
                   heard: bool = True, report: bool = True) -> None:
  """A barrier that also carries failures: a process that failed still
  arrives (after saying so), so the others stop now, not at a timeout.
  ``on_arrival`` runs once every process has arrived, before any failure
  is raised. ``heard`` False: the failures the others reported are not
  read here (process 0 reads and relays them: ``run_save``), and this
  process's own ``error`` is not raised yet either. ``report`` False:
  ``error`` is not reported (process 0 relayed it already)."""
  key = f"{attempt.key}/{name}"
  if error is not None and report:
    # A deadline's own error names the operation, the bound and its option.
    shown = deadline_lib.timeout_in(error) or error
    multihost.report_failure(f"{key}/failed",
                             f"{type(shown).__name__}: {shown}",
                             attempt.timeout_s)
  t0 = time.monotonic()
  await asyncio.to_thread(
      attempt.waiting.wait, key, lambda: multihost.barrier(
          key, timeout_s=attempt.timeout_s,
          what=f"{what}, step {attempt.step}"))
  deadline = deadline_lib.current()
  if deadline is not None:  # waiting for the others is no stall of the store
    deadline.exclude(time.monotonic() - t0)
  on_arrival()
  if not heard:
    return
  if error is not None:
    raise error
  failed = multihost.reported_failures(f"{key}/failed", attempt.timeout_s)
  if failed:
    raise failed(attempt, what, failed)


def failed(attempt: Attempt, what: str,
            failed: dict[int, str]) -> CheckpointError:
  return CheckpointError(
      f"saving step {attempt.step} failed on process(es) {sorted(failed)} "
      f"before '{what}'; nothing was committed. "
      + "; ".join(f"process {p}: {m}" for p, m in sorted(failed.items())))


def relay(attempt: Attempt) -> dict[int, str]:
  """Process 0, after "written": the failures reported there, passed on
  for the others to read after "done" (``done``)."""
  failed = multihost.reported_failures(f"{attempt.key}/written/failed",
                                       attempt.timeout_s)
  if failed:
    multihost.relay_failures(f"{attempt.key}/done/relayed", failed,
                             attempt.timeout_s)
  return failed


async def done(attempt: Attempt, error: BaseException | None,
                report: bool) -> None:
  """9: the barrier "done", after which a process other than 0 reads, in
  one call, what process 0 reported there: its own failure (``failed/0``)
  or the failures it read at "written" (``relayed/<p>``, ``run_save``),
  raised as the barrier "written" raised them before. Process 0 knows
  both already and reads nothing."""
  key = f"{attempt.key}/done"
  await barrier(attempt, "done", DONE, error, heard=False, report=report)
  if error is not None:
    raise error
  if multihost.process_index() == 0:
    return
  got = await asyncio.to_thread(multihost.reported_by_kind, key,
                                attempt.timeout_s)
  if got.get("relayed"):
    raise failed(attempt, WRITTEN, got["relayed"])
  if got.get("failed"):
    raise failed(attempt, DONE, got["failed"])
