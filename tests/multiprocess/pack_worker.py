"""One process of the multi-process packed-leaf test (test_pack_mp.py).

Run through ``ckpt.multihost.local_cluster`` as
``python -m tests.multiprocess.pack_worker <json config>``. The state is
``LEAVES`` small float32 leaves (packed: ckpt/save/pack.py), each sharded
over every device of the job on its first dimension, from fixed seeds, so
each process checks its shards bit for bit against the truth.

One launch saves step 1 into ``config["dir"]`` (its own Checkpointer,
closed), then restores it with a new Checkpointer onto the saved sharding,
then onto the other dimension, and reports, for each, the bytes this process fetched from the store
(``last_restore_stats.fetched_bytes``) and whether every shard is exact;
also the bytes of this process's own packs and of all packs on disk.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from typing import Any

import numpy as np

from tests.multiprocess import worker

LEAVES = 48
SHAPE = (64, 32)  # 8 KiB of float32: packed


def truth(i: int) -> np.ndarray:
  rng = np.random.default_rng(zlib.crc32(f"w{i}".encode()))
  return rng.standard_normal(SHAPE, dtype=np.float32)


def _target(spec) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  sharding = NamedSharding(mesh, spec)
  return {f"w{i}": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding)
          for i in range(LEAVES)}


def _save(config: dict) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  target = _target(P("x"))
  state = {k: jax.make_array_from_callback(
      SHAPE, t.sharding, lambda idx, i=int(k[1:]): truth(i)[idx])
           for k, t in target.items()}
  with ckpt.Checkpointer(config["dir"], async_save=False) as c:
    c.save(1, state)


@dataclasses.dataclass(frozen=True)
class Result:
  process: int
  own_pack_bytes: int     # this process's packs on disk
  all_pack_bytes: int     # every process's
  same_fetched: int       # fetched by the restore onto the saved sharding
  same_exact: bool        # ... every shard bit-exact
  other_fetched: int      # onto the other dimension
  other_exact: bool


def _restore(config: dict) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  out: dict[str, Any] = {}
  step = os.path.join(config["dir"], "checkpoint_1", ".packs")
  me = jax.process_index()
  sizes = {n: os.path.getsize(os.path.join(step, n))
           for n in os.listdir(step) if n.endswith(".bin")}
  out["own_pack_bytes"] = sum(v for n, v in sizes.items()
                              if n.split(".")[0] == str(me))
  out["all_pack_bytes"] = sum(sizes.values())
  with ckpt.Checkpointer(config["dir"]) as c:
    for name, spec in (("same", P("x")), ("other", P(None, "x"))):
      got = c.restore(1, target=_target(spec))
      out[f"{name}_fetched"] = c.last_restore_stats.fetched_bytes
      out[f"{name}_exact"] = all(
          np.asarray(s.data).tobytes() == truth(int(k[1:]))[s.index].tobytes()
          for k, v in got.items() for s in v.addressable_shards)
  return out


def run(config: dict) -> Result:
  import jax  # pylint: disable=g-import-not-at-top
  _save(config)
  return Result(process=jax.process_index(), **_restore(config))


if __name__ == "__main__":
  worker.main(run)
