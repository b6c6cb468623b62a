"""What several 2-process workers share (verify, queries, restore_async):
one (256, 512) float32 leaf on a 2 x 2 mesh, sharded by rows over the
processes (process 0 holds rows 0..127, process 1 rows 128..255: chunk
(1, 0) of the zarr grid is process 1's) and by columns over each
process's 2 devices. Import it after ``local_cluster.init_from_env()``."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

SHAPE = (256, 512)


class GridLeaf:
  """The leaf's mesh, sharding, random values and helpers."""

  def __init__(self):
    self.mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
    self.sharding = NamedSharding(self.mesh, P("x", "y"))
    self.values = np.random.default_rng(0).standard_normal(SHAPE).astype(
        np.float32)
    self.target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32,
                                             sharding=self.sharding)}

  def array(self, offset: float = 0.0) -> jax.Array:
    """The leaf's values + ``offset``, placed."""
    v = self.values + offset
    return jax.make_array_from_callback(SHAPE, self.sharding, lambda i: v[i])

  def state(self, offset: float = 0.0) -> dict:
    return {"w": self.array(offset)}

  def exact(self, tree: dict, offset: float = 0.0) -> bool:
    """Whether every addressable shard of ``tree["w"]`` holds the values
    + ``offset``."""
    v = self.values + offset
    return all(np.array_equal(np.asarray(s.data), v[s.index])
               for s in tree["w"].addressable_shards)
