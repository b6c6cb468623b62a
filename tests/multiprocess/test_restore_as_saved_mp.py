"""Restore as saved (issue 25, item 1) across real ``jax.distributed``
processes (``restore_as_saved_worker.py``; 127.0.0.1, gloo collectives,
real TensorStore arrays on the local disk):

1. 2 processes x 4 devices save on a (data=2, model=4) mesh.
2. 2 x 4 restore with a ``jax.eval_shape`` target (no shardings): every
   leaf a jax.Array with the saved NamedSharding, bit-exact per shard
   (also read once, lazy, the metadata's tree as target, and a jitted step
   over the restored leaves).
3. 2 x 2 (4 devices): the saved mesh cannot be built; every process raises
   TreeMismatchError naming the leaf, the saved mesh and how to pass a
   sharding, and an ``abstract_target`` restore then works.
4. This (one) test process with 8 devices restores the 2-process
   checkpoint in the saved shardings too.
"""

from __future__ import annotations


import jax
import numpy as np
import pytest

import ckpt
from tests.multiprocess import launch as launch_lib
from tests.multiprocess import restore_as_saved_worker as worker

WORKER = "tests.multiprocess.restore_as_saved_worker"


def launch(config: dict, num_processes: int, devices_per_process: int):
  return launch_lib.launch(WORKER, config, num_processes, devices_per_process,
                           result=worker.OPS[config["op"]][1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
  root = str(tmp_path_factory.mktemp("restore_as_saved_mp") / "ckpt")
  launch({"op": "save", "dir": root}, 2, 4)
  return root


ALL = sorted(["params/w", "params/e", "params/b", "opt/mu", "rep", "step",
              "keys", "table"])


def test_an_eval_shape_target_restores_in_the_saved_shardings(saved):
  out = launch({"op": "restore", "dir": saved}, 2, 4)
  for r in out:
    assert r.mismatches == [], "\n".join(r.mismatches)
    assert r.checked == ALL
    assert r.jit_ok
  md = out[0].shardings
  assert md["params/w"] == ("NamedSharding(mesh={'data': 2, 'model': 4}, "
                            "spec=('data', 'model'), axis_types=('explicit', "
                            "'explicit'))")
  assert md["table"] == "replicated (host value)"
  assert out[1].shardings == md


def test_a_saved_mesh_the_job_cannot_build_fails_alike_everywhere(saved):
  out = launch({"op": "restore_small", "dir": saved}, 2, 2)
  assert all(r.restore.error is not None and
             r.restore.error.type == "TreeMismatchError" for r in out), out
  errors = [r.restore.error.msg for r in out]
  assert errors[0] is not None and errors[0] == errors[1], errors
  for part in ("{'data': 2, 'model': 4}", "8 devices", "this job has 4",
               "sharding=", "ckpt.abstract_target"):
    assert part in errors[0], (part, errors[0])
  assert errors[0].startswith("leaf '")
  assert all(r.after_ok for r in out)


def test_one_process_restores_the_two_process_checkpoint_as_saved(saved):
  mesh = worker.make_mesh()  # 8 devices here, in one process
  with ckpt.Checkpointer(saved) as c:
    got = c.restore(1, target=worker.eval_shape_target())
  bad, checked = worker.check(got, mesh, "1 process")
  assert bad == [], "\n".join(bad)
  assert checked == ALL
  assert isinstance(got["params"]["w"], jax.Array)
  assert np.asarray(got["params"]["w"]).tobytes() == worker.truth(
      "params/w").tobytes()
