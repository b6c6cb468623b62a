"""The Orbax calls of issue 25, item 2, across real ``jax.distributed``
processes (``orbax_calls_worker.py``; 2 processes x 2 devices, 127.0.0.1,
gloo, real TensorStore arrays on the local disk):

- ``should_save_fn`` with ``save_interval_steps`` and ``save_on_steps``:
  both processes save the same steps, the function sees the same agreed
  ``last_saved_step`` on each; ``best_step()`` and the step's
  ``custom_metadata`` are the same everywhere.
- ``cancel()`` of a save held mid-way (process 1 wrote its data and waits,
  process 0 waits at the "written" barrier): both return True within
  seconds, nothing is committed, no attempt or pending record is left, the
  next save commits and restores, and ``close`` returns at once (no thread
  left waiting at the cancelled save's barrier).
- The same on a ``MultiTierCheckpointer``: ``should_save_fn`` adds a
  persistent save, ``best_step``/``metadata`` read the persistent tier,
  ``cancel()`` abandons a held persistent save on both processes.
"""

from __future__ import annotations

import pathlib

from ckpt.multihost import local_cluster
from tests.multiprocess import orbax_calls_worker
from tests.multiprocess import worker

REPO = pathlib.Path(__file__).resolve().parents[2]
WORKER = "tests.multiprocess.orbax_calls_worker"
LAUNCH_TIMEOUT_S = 180


def launch(config: dict) -> list:
  """Each process's result of ``config["op"]`` (checked to have raised
  nothing)."""
  out = [worker.decode(orbax_calls_worker.Result, r)
         for r in local_cluster.check(local_cluster.run(
             WORKER, config, num_processes=2, devices_per_process=2,
             timeout_s=LAUNCH_TIMEOUT_S, cwd=str(REPO)))]
  assert [r.process for r in out] == [0, 1]
  assert [r.error for r in out] == [None, None], out
  return [getattr(r, config["op"]) for r in out]


def test_should_save_fn_and_best_step_agree_on_every_process(tmp_path):
  out = launch({"op": "policy", "dir": str(tmp_path / "ckpt")})
  a, b = out
  # 0, 10, 20: the interval; 3: save_on_steps; 17: should_save_fn (7 steps
  # after the last save, 10).
  assert a.saved == b.saved == [0, 3, 10, 17, 20]
  assert a.steps == b.steps == [0, 3, 10, 17, 20]
  assert a.seen == b.seen
  assert a.seen[0] == [1, 0] and [17, 10] in a.seen
  assert a.best_before is None and b.best_before is None
  assert a.best == b.best == 10  # loss |step - 10.5|
  assert a.custom == b.custom == {"data_pos": 1000, "note": "step 10"}


def test_cancel_abandons_a_held_save_on_every_process(tmp_path):
  out = launch({"op": "cancel", "dir": str(tmp_path / "ckpt")})
  assert out[0].p0_waiting and out[0].p0_waiting[0].endswith("/written")
  for r in out:
    assert r.cancel_idle is False
    assert r.in_progress_before is True
    assert len(r.work_dirs_before) == 1  # the held attempt, written into
    assert r.cancelled is True
    assert r.cancel_s < 30, r.cancel_s
    assert r.in_progress_after is False
    assert r.steps_after_cancel == [1]
    assert r.left == []  # no attempt directory, no pending record
    assert r.steps_final == [1, 3]
    assert r.restore_ok
    assert r.close_s < 10, r.close_s  # no barrier thread left behind


def test_multitier_calls_and_cancel_on_every_process(tmp_path):
  out = launch({"op": "multitier", "dir": str(tmp_path)})
  for r in out:
    assert r.persistent == [0, 3, 4]  # 0, 4: the interval; 3: the fn
    assert r.best == 3  # loss |s - 2.6| among the persistent steps
    assert r.custom == {"s": 3}
    assert r.cancelled is True and r.cancel_s < 30
    assert r.persistent_after == [0, 3, 4]
    assert r.saving is False
    assert r.persistent_final == [0, 3, 4, 12]
