"""One process of a job for tests/multiprocess/test_policies_mp.py.

Run as ``python -m tests.multiprocess.policies_worker <json config>`` by
``ckpt.multihost.local_cluster`` (2 processes x 2 CPU devices); the test
may start process 1 under libfaketime, its clock running 10 times faster.

- "interval": a training loop calling ``should_save`` then ``save`` every
  step with ``save_interval_steps`` and ``save_interval_secs`` (temporary
  time saves); each process logs what both calls returned and its own
  ``time.time()`` at each step.
- "skip": ``skip_while_saving=True``; step 0's save is held in process
  ``holder``'s progress callback while both processes call ``should_save``
  and ``save`` for steps 1 and 2; then released; step 3 saves.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from tests.multiprocess import worker


def _state(step: int, mesh) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  host = np.arange(32 * 8, dtype=np.float32).reshape(32, 8) + step
  w = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")),
                                   lambda i: host[i])
  return {"w": w}


def _mesh():
  import jax  # pylint: disable=g-import-not-at-top
  return jax.sharding.Mesh(np.array(jax.devices()), ("x",))


@dataclasses.dataclass(frozen=True)
class Interval:
  asked: list[bool]  # should_save(step) for each step
  saved: list[bool]  # save(step) for each step
  clock: list[float]  # this process's time.time() at each step
  committed: list[int]  # all_steps() at the end
  temporary: list[int]  # committed steps whose index says temporary
  root: dict  # root_metadata().custom_metadata, read by this process


def interval(conf: dict) -> Interval:
  import ckpt  # pylint: disable=g-import-not-at-top
  mesh = _mesh()
  asked, saved, clock = [], [], []
  pause = threading.Event()  # never set: a pacing wait that works under
  # libfaketime (its time.sleep fails when the monotonic clock is real)
  with ckpt.Checkpointer(conf["dir"], save_interval_steps=conf["every"],
                         save_interval_secs=conf["secs"],
                         temporary_time_saves=True,
                         custom_metadata={"run": "mp"}) as c:
    for step in range(conf["steps"]):
      clock.append(time.time())
      ask = c.should_save(step)
      asked.append(ask)
      saved.append(c.save(step, _state(step, mesh)))
      pause.wait(conf["step_s"])
    c.wait_until_finished()
    steps = c.all_steps()
    temporary = [s for s in steps if _temporary(c, s)]
  with ckpt.Checkpointer(conf["dir"]) as reader:  # without the dict
    root = reader.root_metadata().custom_metadata
  return Interval(asked, saved, clock, steps, temporary, root)


def _temporary(c, step: int) -> bool:
  from ckpt.commit import steps as steps_lib  # pylint: disable=g-import-not-at-top
  from ckpt.restore import read as restore_lib  # pylint: disable=g-import-not-at-top
  return restore_lib.read_index(
      c.storage, steps_lib.step_dir(c.storage, step)).temporary


@dataclasses.dataclass(frozen=True)
class Skip:
  during: list[bool]  # should_save(1), save(1), should_save(2), save(2)
  after: list[bool]  # should_save(3), save(3)
  committed: list[int]


def skip(conf: dict) -> Skip:
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  mesh = _mesh()
  writing, release = threading.Event(), threading.Event()
  held = jax.process_index() == conf["holder"]

  def hold(done, total):
    writing.set()
    if held:
      release.wait(120)

  with ckpt.Checkpointer(conf["dir"], skip_while_saving=True) as c:
    assert c.save(0, _state(0, mesh), progress=hold)
    writing.wait(120)
    try:
      during = [c.should_save(1), c.save(1, _state(1, mesh)),
                c.should_save(2), c.save(2, _state(2, mesh))]
    finally:
      release.set()
    c.wait_until_finished()
    after = [c.should_save(3), c.save(3, _state(3, mesh))]
    c.wait_until_finished()
    return Skip(during, after, c.all_steps())


@dataclasses.dataclass(frozen=True)
class ClockFails:
  save: worker.Outcome  # save(1) while process 0's clock raises
  should: worker.Outcome  # should_save(2)
  after: worker.Outcome  # save(3, force=True): the Checkpointer still works
  committed: list[int]


def clock_fails(conf: dict) -> ClockFails:
  """Process 0's clock raises inside the decision round (after the reading
  that starts the interval): every process raises the same error, and the
  Checkpointer takes the next save."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  mesh = _mesh()
  calls = []

  def clock() -> float:
    calls.append(1)
    if jax.process_index() == 0 and len(calls) == 2:
      raise RuntimeError("the clock broke")
    return time.time()

  with ckpt.Checkpointer(conf["dir"], save_interval_secs=3600,
                         clock=clock) as c:
    save = worker.timed(c.save, 1, _state(1, mesh))
    should = worker.timed(c.should_save, 2)
    after = worker.timed(c.save, 3, _state(3, mesh), force=True)
    c.wait_until_finished()
    return ClockFails(save, should, after, c.all_steps())


@dataclasses.dataclass(frozen=True)
class Differ:
  saved: list[bool]  # save(1..20)
  committed: list[int]
  round_s: float  # mean seconds of one save() call that skipped


def differ(conf: dict) -> Differ:
  """The step rules disagree between processes (process 1's should_save_fn
  accepts every step, process 0's none: a misuse): with save_interval_secs
  both take process 0's answer in the same round, none waits alone."""
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  mesh = _mesh()
  mine = jax.process_index() == 1
  with ckpt.Checkpointer(conf["dir"], save_interval_secs=3600,
                         should_save_fn=lambda s, last: mine) as c:
    t0 = time.monotonic()
    saved = [c.save(s, _state(s, mesh)) for s in range(1, 21)]
    took = (time.monotonic() - t0) / 20
    c.wait_until_finished()
    return Differ(saved, c.all_steps(), took)


if __name__ == "__main__":
  worker.main({"interval": interval, "skip": skip, "clockfail": clock_fails,
               "differ": differ})
