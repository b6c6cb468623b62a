"""One process of the multi-process restore-as-saved test (issue 25, item 1).

Run by ``test_restore_as_saved_mp.py`` through ``ckpt.multihost.local_cluster`` as
``python -m tests.multiprocess.restore_as_saved_worker <json config>``;
every process runs this same program. The global arrays come from fixed
seeds, so each process checks every shard it holds against the truth, bit
for bit, without talking to the others.

Operations (``config["op"]``):

- ``save`` (2 processes x 4 devices): the state of ``LEAVES`` on
  ``jax.make_mesh((2, 4), ("data", "model"))`` (Explicit axes, jax's
  default), a replicated scalar kept inline, typed keys, and a host numpy
  table, saved as step 1 into ``config["dir"]``.
- ``restore`` (2 x 4): the Orbax user's restore: a target from
  ``jax.eval_shape`` (ShapeDtypeStructs without shardings). Each leaf must
  be a jax.Array with the saved NamedSharding (the same mesh and spec),
  every addressable shard bit-exact (the host numpy table: numpy, as
  saved); also with ``read_once=True``, with
  ``lazy=True`` and with the metadata's own tree as the target; a jitted
  step must take the leaves together.
- ``restore_small`` (2 x 2): the saved mesh (8 devices) cannot be built on
  4: every process must raise TreeMismatchError naming the leaf, the saved
  mesh and how to pass a sharding; then ``ckpt.abstract_target`` onto the
  job's mesh restores it.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import ml_dtypes
import numpy as np

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome

MESH_SHAPE, MESH_AXES = (2, 4), ("data", "model")
_F32, _BF16 = np.dtype("float32"), np.dtype(ml_dtypes.bfloat16)
# path -> (shape, dtype, PartitionSpec entries when saved)
LEAVES: dict[str, tuple[tuple[int, ...], np.dtype, tuple]] = {
    "params/w": ((32, 64), _F32, ("data", "model")),
    "params/e": ((64, 16), _BF16, (None, "model")),
    "params/b": ((64,), _F32, ("model",)),
    "opt/mu": ((32, 64), _F32, (("data", "model"), None)),
    "rep": ((20, 20), _F32, ()),            # stored, replicated
}
TABLE_SHAPE = (300,)                        # host numpy, no partitioner
STEP_VALUE = 7                              # a replicated scalar, inline


def truth(path: str) -> np.ndarray:
  shape, dtype, _ = LEAVES[path]
  rng = np.random.default_rng(zlib.crc32(path.encode()))
  return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def table() -> np.ndarray:
  return np.arange(TABLE_SHAPE[0], dtype=np.int32) * 3 - 11


def keys_data() -> np.ndarray:
  import jax  # pylint: disable=g-import-not-at-top
  return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(5),
                                                         16)))


def make_mesh():
  import jax  # pylint: disable=g-import-not-at-top
  return jax.make_mesh(MESH_SHAPE, MESH_AXES)


def saved_shardings(mesh) -> dict[str, Any]:
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  out = {p: NamedSharding(mesh, P(*spec)) for p, (_, _, spec) in LEAVES.items()}
  out["step"] = NamedSharding(mesh, P())
  out["keys"] = NamedSharding(mesh, P("data"))
  return out


def make_state(mesh) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  shardings = saved_shardings(mesh)
  flat = {p: jax.make_array_from_callback(
      LEAVES[p][0], shardings[p], lambda i, p=p: truth(p)[i]) for p in LEAVES}
  data = keys_data()
  key_data = jax.make_array_from_callback(
      data.shape, jax.sharding.NamedSharding(
          mesh, jax.sharding.PartitionSpec("data", None)),
      lambda i: data[i])
  return {"params": {"w": flat["params/w"], "e": flat["params/e"],
                     "b": flat["params/b"]},
          "opt": {"mu": flat["opt/mu"]}, "rep": flat["rep"],
          "step": jax.device_put(jnp.int32(STEP_VALUE), shardings["step"]),
          "keys": jax.random.wrap_key_data(key_data, impl="threefry2x32"),
          "table": table(), "name": "mp-run"}


def eval_shape_target() -> Any:
  """What ``jax.eval_shape(create_state)`` gives: no shardings."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def create_state():
    z = {p: jnp.zeros(s, d) for p, (s, d, _) in LEAVES.items()}
    return {"params": {"w": z["params/w"], "e": z["params/e"],
                       "b": z["params/b"]},
            "opt": {"mu": z["opt/mu"]}, "rep": z["rep"],
            "step": jnp.int32(0),
            "keys": jax.random.split(jax.random.key(0), 16),
            "table": jnp.zeros(TABLE_SHAPE, jnp.int32)}

  out = jax.eval_shape(create_state)
  assert all(x.sharding is None for x in jax.tree.leaves(out)), out
  out["name"] = ""
  return out


def flat(tree) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  return {"/".join(str(getattr(k, "key", k)) for k in p): x
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check(got: Any, mesh, what: str) -> tuple[list[str], list[str]]:
  """(mismatches, leaves checked) of a restored tree against the truth."""
  import jax  # pylint: disable=g-import-not-at-top
  shardings = saved_shardings(mesh)
  values = {p: truth(p) for p in LEAVES}
  values["step"] = np.asarray(STEP_VALUE, np.int32)
  values["table"] = table()
  values["keys"] = keys_data()
  bad, checked = [], []
  for name, x in flat(got).items():
    if name == "name":
      if x != "mp-run":
        bad.append(f"{what}: name is {x!r}")
      continue
    checked.append(name)
    if name == "table":  # saved from host numpy: numpy, as saved
      if type(x) is not np.ndarray or x.tobytes() != table().tobytes():
        bad.append(f"{what}: table is a {type(x).__name__} (expected the "
                   "saved numpy.ndarray)")
      continue
    if not isinstance(x, jax.Array):
      bad.append(f"{what}: {name} is a {type(x).__name__}, expected a "
                 "jax.Array")
      continue
    if x.sharding != shardings[name]:
      bad.append(f"{what}: {name} has sharding {x.sharding}, expected "
                 f"{shardings[name]}")
    is_keys = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    data = jax.random.key_data(x) if is_keys else x
    for shard in data.addressable_shards:
      want = values[name][shard.index]
      have = np.asarray(shard.data)
      if have.dtype != want.dtype or have.tobytes() != want.tobytes():
        bad.append(f"{what}: {name} shard {shard.index} on {shard.device} "
                   "differs from the saved data")
  return bad, sorted(checked)


@dataclasses.dataclass(frozen=True)
class Saved:
  process: int


@dataclasses.dataclass(frozen=True)
class Restored:
  """op "restore"."""
  process: int
  mismatches: list[str]      # of every restore, bit-exact and sharding
  checked: list[str]         # the leaves checked
  shardings: dict[str, str]  # metadata(1).shardings, as str()
  jit_ok: bool               # a jitted step over restored leaves


@dataclasses.dataclass(frozen=True)
class Small:
  """op "restore_small": a job smaller than the saved mesh."""
  process: int
  restore: Outcome   # onto the eval_shape target (the saved mesh)
  after_ok: bool     # then onto ckpt.abstract_target of the job's mesh


def _save(config: dict) -> dict:
  import ckpt  # pylint: disable=g-import-not-at-top
  with ckpt.Checkpointer(config["dir"]) as c:
    c.save(1, make_state(make_mesh()))
    c.wait_until_finished()
  return {}


def _restore(config: dict) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  mesh = make_mesh()
  out: dict[str, Any] = {"mismatches": []}
  with ckpt.Checkpointer(config["dir"]) as c:
    for what, kwargs in [("eval_shape", {}),
                         ("read_once", {"read_once": True})]:
      got = c.restore(1, target=eval_shape_target(), **kwargs)
      bad, out["checked"] = check(got, mesh, what)
      out["mismatches"] += bad
    lazy = c.restore(1, target=eval_shape_target(), lazy=True)
    got = jax.tree.map(lambda x: x.read() if isinstance(x, ckpt.LazyLeaf)
                       else x, lazy)
    out["mismatches"] += check(got, mesh, "lazy")[0]
    md = c.metadata(1)
    out["mismatches"] += check(c.restore(1, target=md.tree), mesh,
                               "metadata tree")[0]
    out["shardings"] = {k: str(v) for k, v in md.shardings.items()}
    # A jitted step takes the restored leaves together (one mesh).
    got = c.restore(1, target=eval_shape_target())
    total = jax.jit(lambda w, step, t: w.sum() * step + t.sum())(
        got["params"]["w"], got["step"], got["table"])
    want = (truth("params/w").sum(dtype=np.float32) * STEP_VALUE +
            table().sum())
    out["jit_ok"] = bool(np.isclose(float(np.asarray(total)), want,
                                    rtol=1e-4))
  return out


def _restore_small(config: dict) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  out: dict[str, Any] = {}
  with ckpt.Checkpointer(config["dir"]) as c:
    out["restore"] = worker.timed(c.restore, 1, target=eval_shape_target())
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    target = ckpt.abstract_target(c.metadata(1), mesh,
                                  [(r"params/w", P("data", "model"))])
    got = c.restore(1, target=target)["params"]["w"]
    out["after_ok"] = (got.sharding.mesh.shape == {"data": 2, "model": 2} and
                       all(np.asarray(s.data).tobytes() ==
                           truth("params/w")[s.index].tobytes()
                           for s in got.addressable_shards))
  return out


OPS = {"save": (_save, Saved), "restore": (_restore, Restored),
       "restore_small": (_restore_small, Small)}


def run(config: dict) -> Saved | Restored | Small:
  import jax  # pylint: disable=g-import-not-at-top
  fn, result = OPS[config["op"]]
  return result(process=jax.process_index(), **fn(config))


if __name__ == "__main__":
  worker.main(run)
