"""Ways to bring a sharded state from a GPU to host numpy, timed (issue 37.6).

``python -m scripts.gpu_d2h --gib 4``: for each way, three times on fresh
device copies (a jax.Array caches its host value): wall seconds, GB/s and
minor page faults, and whether the bytes are equal.

- ``device_get``: ``jax.device_get`` (a fresh pageable buffer per array).
- ``async_then_asarray``: ``copy_to_host_async`` on every array, then
  ``np.asarray`` (what ckpt's staging does).
- ``pinned_host``: ``jax.device_put`` onto the same sharding with
  ``memory_kind="pinned_host"``, then ``np.asarray`` of each shard.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def _faults() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gib", type=float, default=4.0)
  ap.add_argument("--leaves", type=int, default=32)
  args = ap.parse_args(argv)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  rows = 4096
  cols = int(args.gib * (1 << 30) / args.leaves / 4 / rows)
  make = jax.jit(lambda k: jax.random.normal(k, (rows, cols), jnp.float32),
                 out_shardings=sharding)
  state = [make(jax.random.key(i)) for i in range(args.leaves)]
  jax.block_until_ready(state)
  nbytes = sum(x.nbytes for x in state)
  check = [np.asarray(x[:2, :8]) for x in state]

  def device_get(xs):
    return jax.device_get(xs)

  def async_then_asarray(xs):
    for x in xs:
      x.copy_to_host_async()
    return [np.asarray(x) for x in xs]

  def pinned_host(xs):
    pinned = sharding.with_memory_kind("pinned_host")
    hs = jax.device_put(xs, [pinned] * len(xs))
    jax.block_until_ready(hs)
    return [np.asarray(h.addressable_shards[0].data) for h in hs]

  for fn in (device_get, async_then_asarray, pinned_host):
    for rep in range(3):
      fresh = [x.copy() for x in state]
      jax.block_until_ready(fresh)
      f0, t0 = _faults(), time.perf_counter()
      try:
        out = fn(fresh)
      except Exception as e:  # pylint: disable=broad-except
        print(json.dumps({"way": fn.__name__, "error": repr(e)[:300]}),
              flush=True)
        break
      wall = time.perf_counter() - t0
      faults = _faults() - f0
      equal = all(np.array_equal(np.asarray(o)[:2, :8], c)
                  for o, c in zip(out, check))
      print(json.dumps({"way": fn.__name__, "rep": rep, "wall_s": wall,
                        "gbps": nbytes / wall / 1e9, "faults": faults,
                        "equal": equal}), flush=True)
      del out, fresh


if __name__ == "__main__":
  main()
