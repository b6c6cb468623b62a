"""One restore between its agreed choice of step and its result
(ckpt/face/restorer.py drives it): the request as the public call made
it, the state of its attempts, and the small steps of
waiting for and cancelling its reads on the background loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import numpy as np

from ckpt.errors import WaitTimeoutError

if TYPE_CHECKING:
  from ckpt.restore import readcount, readonce
  from ckpt.store import storage as storage_lib, storemeter


@dataclasses.dataclass(frozen=True, eq=False)
class RestoreRequest:
  """One call of ``Checkpointer.restore`` / ``restore_async``, as given:
  built once by the public call and carried whole to the reading (see
  ``Checkpointer.restore`` for each field)."""
  step: int | None = None
  target: Any = None
  path: str | None = None
  transforms: Sequence[Callable] = ()
  fallback_state: Any = None
  lazy: bool = False
  verify: bool = True
  read_once: Any = "default"  # "default": the Checkpointer's
  progress: Any = None

  @property
  def may_fall_back(self) -> bool:
    """A resume falls back past steps that fail verification (on every
    process alike: the Restorer's fallback round); an explicit step or
    path raises."""
    return (self.verify and not self.lazy and self.path is None and
            self.step is None)


@dataclasses.dataclass(eq=False)
class RestoreJob:
  """One restore between its agreed choice of step and its result: the
  request, and the runtime state of its attempts."""
  request: RestoreRequest
  storage: "storage_lib.Storage"  # the Checkpointer's, or the path's
  step: int | None  # agreed (None: a path restore that named no step)
  step_dir: str
  is_resuming: bool
  protected: int | None  # process 0: held from retention until released
  read_once: bool | None  # the request's, "default" resolved
  read_once_min: int | None
  key: str
  run_key: str  # the rounds' key of the attempt in progress
  t_start: float
  meter: "storemeter.Meter"
  find_s: float = 0.0
  report: Callable[[int], None] | None = None  # progress (store/progress.py)
  damaged: list[int] = dataclasses.field(default_factory=list)
  attempt: int = 0
  # Of the attempt in progress (the Restorer's _start_reads).
  reading: str = ""
  stats: "readonce.RestoreStats | None" = None
  counter: "readcount.ReadCounter | None" = None
  rounds: bool = False
  t_read: float = 0.0
  task: "asyncio.Task | None" = None


def wait_reads(fut, timeout: float | None, job: RestoreJob) -> None:
  """Waits for an attempt's reads; WaitTimeoutError (the reads go on) if
  they are not done after ``timeout`` seconds."""
  concurrent.futures.wait([fut], timeout)
  if not fut.done():
    raise WaitTimeoutError(
        f"result(timeout={timeout}): the reads of step {job.step} were not "
        f"done after {timeout} s; they go on (call result() again)")


def target_bytes(target: Any) -> int | None:
  """The bytes of the boxes this process's devices hold of every target
  leaf with a sharding (None with no such leaf: the total is not known
  before the index is read)."""
  total, known = 0, False
  for leaf in jax.tree_util.tree_leaves(target):
    sharding = getattr(leaf, "sharding", None)
    shape = getattr(leaf, "shape", None)
    if sharding is None or shape is None or not hasattr(
        sharding, "addressable_devices_indices_map"):
      continue
    known = True
    shape = tuple(shape)
    boxes = {tuple(s.indices(n)[:2] for s, n in zip(idx, shape))
             for idx in sharding.addressable_devices_indices_map(
                 shape).values()}
    item = np.dtype(leaf.dtype).itemsize
    total += sum(item * math.prod(b - a for a, b in box) for box in boxes)
  return total if known else None


async def tracked(job: RestoreJob, coro) -> Any:
  """Runs ``coro`` as the job's reads task (``cancelled`` cancels it)."""
  job.task = asyncio.current_task()
  return await coro


async def cancelled(job: RestoreJob) -> None:
  """On the loop: the reads' task cancelled, and waited for (its
  TensorStore requests end first, ckpt/store/tsfuture.py)."""
  task = job.task
  if task is not None and not task.done():
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
