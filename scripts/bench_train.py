"""Training while saving: scripts/bench.py's ``train`` op.

A jitted training step (a two-layer MLP with its SGD update, data-parallel
over the "data" axis and the hidden layer split over "model" of the preset's
save mesh) runs ``steps`` times with nothing else going on, then again while
an asynchronous save of the benchmark's state runs in the background, until
that save is finished. Every step is timed to ``block_until_ready``. The
figures: the median and 90th percentile step time without and during the
save, their ratio (the slowdown a training job sees), the time the caller
was blocked in ``save()`` and the save's total time (start to finished).

The step's size (``--train-width``) sets its time: 512 gives about 50-150 ms
on 8 CPU devices over 2 cores.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np

# A save that does not finish within this many steps is reported as such
# (the loop stops; the save is still waited for).
MAX_STEPS_DURING = 100_000


class TrainLoop:
  """The model, its sharded parameters and batch, and the jitted step."""

  def __init__(self, mesh, width: int, seed: int = 0):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
    self.jax = jax
    rng = np.random.default_rng([seed, 1])
    hidden = 4 * width

    def put(shape, spec, scale):
      x = (rng.standard_normal(shape, dtype=np.float32) * scale)
      return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    self.params = {
        "w1": put((width, hidden), (None, "model"), width ** -0.5),
        "w2": put((hidden, width), ("model", None), hidden ** -0.5)}
    self.batch = put((width, width), ("data", None), 1.0)

    def loss(params, x):
      h = jnp.tanh(x @ params["w1"])
      return jnp.mean((h @ params["w2"] - x) ** 2)

    def step(params, x):
      value, grads = jax.value_and_grad(loss)(params, x)
      params = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
      return params, value

    self._step = jax.jit(step, donate_argnums=0)
    for _ in range(3):  # compile and warm up
      self.step()

  def step(self) -> float:
    """One step, to block_until_ready; its wall time."""
    t0 = time.perf_counter()
    self.params, value = self._step(self.params, self.batch)
    self.jax.block_until_ready((self.params, value))
    return time.perf_counter() - t0


def _p90(values: list[float]) -> float:
  return float(np.percentile(values, 90)) if values else float("nan")


def train_while_saving(loop: TrainLoop, steps: int,
                       start_save: Callable[[], Callable[[], None] | None]
                       ) -> dict[str, Any]:
  """``steps`` steps alone, then steps until the save ``start_save`` starts
  (it returns the function that waits for it, or None: unsupported) is
  finished."""
  idle = [loop.step() for _ in range(steps)]
  t0 = time.perf_counter()
  wait = start_save()
  if wait is None:
    return {"op": "train", "unsupported": True}
  blocked = time.perf_counter() - t0
  finished = threading.Event()
  end: dict[str, Any] = {}

  def waiter():
    try:
      wait()
    except BaseException as e:  # pylint: disable=broad-except
      end["error"] = e
    end["t"] = time.perf_counter()
    finished.set()

  thread = threading.Thread(target=waiter, name="bench-save-wait",
                            daemon=True)
  thread.start()
  during = [loop.step()]  # at least one: it starts while the save runs
  while not finished.is_set() and len(during) < MAX_STEPS_DURING:
    during.append(loop.step())
  thread.join()
  if "error" in end:
    raise end["error"]
  med_idle = float(np.median(idle))
  med_during = float(np.median(during))
  return {"op": "train", "steps_idle": len(idle), "steps_during": len(during),
          "step_idle_s": med_idle, "step_idle_p90_s": _p90(idle),
          "step_during_s": med_during, "step_during_p90_s": _p90(during),
          "slowdown": med_during / med_idle, "save_blocked_s": blocked,
          "save_total_s": end["t"] - t0}


# The figures bench.py records from a train op, and the table's rows.
FIGURES = ("step_idle_s", "step_idle_p90_s", "step_during_s",
           "step_during_p90_s", "slowdown", "save_blocked_s", "save_total_s",
           "steps_during")
ROWS = [
    ("train_step_idle_s", "train step, no save: median (s)"),
    ("train_step_idle_p90_s", "train step, no save: p90 (s)"),
    ("train_step_during_s", "train step during async save: median (s)"),
    ("train_step_during_p90_s", "train step during async save: p90 (s)"),
    ("train_slowdown", "train slowdown during save (x)"),
    ("train_save_blocked_s", "train: save() blocked (s)"),
    ("train_save_total_s", "train: async save until finished (s)"),
]
