"""One process of a job for tests/tiers/test_mesh_context.py: every public
call of ``Checkpointer`` and ``MultiTierCheckpointer`` made inside the
caller's mesh context (``config["context"]``: "set_mesh" for
``with jax.set_mesh(mesh):``, "with_mesh" for ``with mesh:``), as
docs/flax.md trains. The state holds what a training state holds: arrays
sharded on the mesh, a replicated scalar (the optimizer's count), a typed
PRNG key, a numpy value and an uncommitted ``jnp`` scalar.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from tests.multiprocess import worker


@dataclasses.dataclass
class Calls:
  """Each public call's outcome, by name, and whether what came back is
  the saved state (bit-exact, on the target's shardings)."""
  checkpointer: dict[str, worker.Outcome]
  multitier: dict[str, worker.Outcome]
  # The local tier restored from the partner's replica (a process lost
  # its local directory): the inverse exchange, in the context too.
  partner: worker.Outcome


def run(conf: dict) -> Calls:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  auto = (AxisType.Auto, AxisType.Auto)
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=auto)

  def put(a, spec):
    return jax.make_array_from_callback(
        a.shape, NamedSharding(mesh, spec), lambda i: a[i])

  w = np.arange(64, dtype=np.float32).reshape(8, 8)

  def state(step: int) -> dict:
    key = np.asarray(jax.random.key_data(jax.random.key(step)))
    return {"w": put(w + step, P(None, "model")),
            "count": put(np.asarray(step, np.int32), P()),
            "key": jax.random.wrap_key_data(put(key, P())),
            "np": np.full((3,), step, np.int64),
            "loose": jnp.asarray(step)}

  def target() -> dict:
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        if isinstance(a, jax.Array) else a, state(0))

  def exact(got, step: int) -> bool:
    want = state(step)
    ok = all(np.array_equal(np.asarray(s.data), (w + step)[s.index])
             for s in got["w"].addressable_shards)
    ok &= got["w"].sharding == want["w"].sharding
    ok &= int(np.asarray(got["count"].addressable_shards[0].data)) == step
    ok &= bool(np.array_equal(
        jax.random.key_data(got["key"]).addressable_shards[0].data,
        jax.random.key_data(jax.random.key(step))))
    ok &= bool(np.array_equal(got["np"], want["np"]))
    return bool(ok and int(got["loose"]) == step)

  context = (jax.set_mesh(mesh) if conf["context"] == "set_mesh" else
             mesh if conf["context"] == "with_mesh" else
             contextlib.nullcontext())

  def calls(c, extra=()) -> dict[str, worker.Outcome]:
    out = {}

    def call(name, fn):
      out[name] = worker.timed(fn)

    call("should_save", lambda: c.should_save(1))
    for name, fn in extra:
      call(name, fn)
    call("save", lambda: c.save(1, state(1), force=True))
    call("is_saving_in_progress", c.is_saving_in_progress)
    call("wait_until_finished", c.wait_until_finished)
    call("check_for_errors", c.check_for_errors)
    call("save_2", lambda: c.save(2, state(2), metrics={"loss": 0.5},
                                  force=True, host_state={"pid": 1}))
    call("cancel", c.cancel)
    call("save_3", lambda: c.save(3, state(3), metrics={"loss": 0.25},
                                  force=True, host_state={"pid": 3}))
    call("wait_3", c.wait_until_finished)
    call("last_saved_step", c.last_saved_step)
    call("latest_step", c.latest_step)
    call("all_steps", c.all_steps)
    call("best_step", c.best_step)
    call("metrics", lambda: c.metrics(3))
    call("metadata", lambda: sorted(c.metadata(3).shardings))
    call("restore", lambda: exact(c.restore(target=target()), 3))
    call("restore_1", lambda: exact(c.restore(1, target=target()), 1))
    call("restore_async", lambda: exact(
        c.restore_async(target=target()).result(), 3))
    call("host_state", lambda: c.host_state(3))
    call("reload", c.reload)
    call("reached_preemption", lambda: c.reached_preemption(4))
    call("delete", lambda: c.delete(1))
    call("directory", lambda: str(c.directory))
    call("close", c.close)
    return out

  with context:
    ck = ckpt.Checkpointer(conf["checkpointer"], barrier_timeout_s=60,
                           best_metric="loss", best_mode="min")
    checkpointer = calls(ck)
    mt = ckpt.MultiTierCheckpointer(
        conf["persistent"], local=conf["local"], persistent_interval=2,
        barrier_timeout_s=60, best_metric="loss", best_mode="min")
    multitier = calls(mt, [("should_save_local",
                            lambda: mt.should_save_local(1)),
                           ("should_save_persistent",
                            lambda: mt.should_save_persistent(1))])
    # A process that lost its local directory gets its part of step 3
    # back from its partner's replica (the inverse exchange).
    pid = jax.process_index()
    again = ckpt.MultiTierCheckpointer(
        conf["persistent"], local=conf["local"], persistent_interval=2,
        barrier_timeout_s=60)
    if pid == 1:
      import shutil  # pylint: disable=g-import-not-at-top
      shutil.rmtree(f"{conf['local']}/process_1")

    def from_partner():
      got = exact(again.restore(target=target()), 3)
      return [got, again.last_restore_tier, again.last_restore_step]
    partner = worker.timed(from_partner)
    again.close()
  return Calls(checkpointer, multitier, partner)


if __name__ == "__main__":
  worker.main(run)
