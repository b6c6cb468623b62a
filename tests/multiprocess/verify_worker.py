"""Worker: 2 processes save steps 1 and 2 of a leaf sharded by rows (each
process holds half); process 0 then damages a chunk of step 2 that only
process 1 reads. A resume (restore() with no step) must fall back to step 1
on both processes; an explicit restore(2) raises on process 1 (the one that
reads the damaged chunk)."""

import json
import sys

from ckpt.multihost import local_cluster


def main():
  local_cluster.init_from_env()
  conf = json.loads(sys.argv[1])
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
  sharding = NamedSharding(mesh, P("x", "y"))
  g = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)

  def arr(v):
    return jax.make_array_from_callback(g.shape, sharding, lambda i: v[i])

  with ckpt.Checkpointer(conf["dir"], async_save=False) as c:
    c.save(1, {"w": arr(g)})
    c.save(2, {"w": arr(g + 1)})
  # Rows 128.. live on process 1's devices: chunk (1, 0) of the zarr grid.
  rows = {s.index[0].start for s in arr(g).addressable_shards}
  if jax.process_index() == 0:
    path = f"{conf['dir']}/checkpoint_2/w/1.0"
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))
  multihost.barrier("damaged", timeout_s=60)
  c = ckpt.Checkpointer(conf["dir"], async_save=False, keep=1,
                        barrier_timeout_s=60)
  target = {"w": jax.ShapeDtypeStruct(g.shape, g.dtype, sharding=sharding)}
  got = c.restore(target=target)
  resumed = c.last_restore_step
  exact = all(np.array_equal(np.asarray(s.data), g[s.index])
              for s in got["w"].addressable_shards)
  try:
    c.restore(2, target=target)
    explicit = None
  except ckpt.CorruptCheckpointError as e:
    explicit = str(e)
  c.save(3, {"w": arr(g + 3)})  # training goes on; keep=1 keeps 2 and 3
  steps = c.all_steps()
  local_cluster.write_result({
      "process": jax.process_index(), "rows": sorted(rows), "step": resumed, "exact": exact,
      "explicit": explicit, "steps": steps})
  c.close()


if __name__ == "__main__":
  main()
