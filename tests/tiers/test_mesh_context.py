"""Issue 45 item 2: nothing in ckpt depends on the caller's mesh context.
``MultiTierCheckpointer.save()`` inside ``with jax.set_mesh(mesh):`` (how
docs/flax.md trains) raised ``ValueError: Received incompatible devices
for jitted computation ... broadcast_in_dim`` from the local tier's save
(a 0-d leaf's block given a leading axis by a jax op, which the context
mesh claimed). Every public call of both classes, in a real 2-process job,
under ``jax.set_mesh(mesh)`` and under ``with mesh:``.
"""

from __future__ import annotations

import pytest

from ckpt.multihost import local_cluster
from tests.multiprocess import launch
from tests.multiprocess import tiers_mesh_worker
from tests.multiprocess import worker

WORKER = "tests.multiprocess.tiers_mesh_worker"


@pytest.mark.parametrize("context", ["set_mesh", "with_mesh"])
def test_every_public_call_works_inside_the_callers_mesh(context, tmp_path):
  conf = {"context": context, "checkpointer": str(tmp_path / "ck"),
          "persistent": str(tmp_path / "persistent"),
          "local": str(tmp_path / "local")}
  results = [worker.decode(tiers_mesh_worker.Calls, r) for r in
             local_cluster.check(local_cluster.run(
                 WORKER, conf, num_processes=2, devices_per_process=2,
                 timeout_s=launch.TIMEOUT_S, cwd=str(launch.REPO)))]
  # Every failed call of every process, whole (a repr would be cut short).
  failed = [f"process {pid} {which}.{n}: {o.error.type}: {o.error.msg}"
            for pid, r in enumerate(results)
            for which, calls in (("Checkpointer", r.checkpointer),
                                 ("MultiTierCheckpointer", r.multitier))
            for n, o in calls.items() if not o.ok]
  assert not failed, f"{context}:\n" + "\n".join(failed)
  for r in results:
    for which, calls in (("Checkpointer", r.checkpointer),
                         ("MultiTierCheckpointer", r.multitier)):
      for name in ("restore", "restore_1", "restore_async"):
        assert calls[name].value is True, (context, which, name)
      assert calls["latest_step"].value == 3, (which, calls["latest_step"])
      assert calls["save"].value is True and calls["save_3"].value is True
    assert r.partner.ok, r.partner.error
    assert r.partner.value == [True, "local", 3], r.partner
