"""One process of the 2-process save that ``test_cli.py`` inspects.

Run through ``ckpt.multihost.local_cluster`` as ``python -m tests.cli.save_worker
<json config>``: 2 processes x 2 CPU devices save ``state()`` on a
(data=2, model=2) mesh as ``config["step"]`` of ``config["dir"]``. Every
leaf's global value comes from ``value(path)``, so the test can check what
the ``ckpt`` command reads back without talking to the workers.
"""

from __future__ import annotations

import dataclasses
import zlib

import ml_dtypes
import numpy as np

from tests.multiprocess import worker

# path -> (shape, dtype, PartitionSpec axes on the (data, model) mesh)
ARRAYS = {
    "params/w": ((64, 32), np.float32, ("data", "model")),
    "params/b": ((256,), ml_dtypes.bfloat16, ("model",)),
    "opt/mu/w": ((64, 32), np.float32, ("data", None)),
    "ema": ((128, 16), np.float32, ()),  # replicated over both processes
}
VALUES = {"step": 7, "name": "two-process"}


def value(path: str) -> np.ndarray:
  shape, dtype, _ = ARRAYS[path]
  rng = np.random.default_rng(zlib.crc32(path.encode()))
  return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def nested(leaf) -> dict:
  out: dict = {}
  for path in [*ARRAYS, *VALUES]:
    node = out
    *parents, last = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = leaf(path)
  return out


@dataclasses.dataclass(frozen=True)
class Saved:
  process: int


def run(config: dict) -> Saved:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))

  def leaf(path):
    if path in VALUES:
      return VALUES[path]
    data = value(path)
    sharding = NamedSharding(mesh, P(*ARRAYS[path][2]))
    return jax.make_array_from_callback(data.shape, sharding,
                                        lambda i: data[i])

  with ckpt.Checkpointer(config["dir"], async_save=False) as ckptr:
    ckptr.save(config["step"], nested(leaf), metrics={"loss": 0.25})
  return Saved(jax.process_index())


if __name__ == "__main__":
  worker.main(run)
