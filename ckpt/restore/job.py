"""One restore between its agreed choice of step and its result
(ckpt/face/restorer.py drives it): its state, and the small steps of
waiting for and cancelling its reads on the background loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
from typing import Any

import jax
import numpy as np

from ckpt.errors import WaitTimeoutError


@dataclasses.dataclass(eq=False)
class RestoreJob:
  """One restore between its agreed choice of step and its result."""
  storage: Any
  step: Any
  step_dir: str
  path: Any
  is_resuming: bool
  protected: int | None
  target: Any
  transforms: tuple
  fallback_state: Any
  lazy: bool
  verify: bool
  read_once: Any
  read_once_min: int | None
  key: str
  run_key: str
  t_start: float
  meter: Any
  may_fall_back: bool
  find_s: float = 0.0
  agree_outcome: bool = False  # multi-process, no fallback: one outcome round
  report: Any = None  # progress (ckpt/store/progress.py)
  damaged: list = dataclasses.field(default_factory=list)
  attempt: int = 0
  # Of the attempt in progress (_start_reads).
  reading: str = ""
  stats: Any = None
  counter: Any = None
  rounds: bool = False
  t_read: float = 0.0
  task: Any = None


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
