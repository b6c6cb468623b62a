"""One process of the multi-process load_safetensors tests
(tests/multiprocess/test_hf_mp.py on a disk, tests/objectstore/test_hf_s3.py
on moto's S3).

SPMD, P processes x D devices: the mesh ("proc", "model") has shape (P, D),
"proc" spanning the processes. Every process regenerates the tiny llama of
tests/hf/llama.py from its seed (so it checks each shard it holds against
the truth, bit for bit) and loads ``config["src"]`` (written by the test)
onto the scanned tree with llama.NAMES:

- ``layout="shard"``: every leaf split over "proc" (the layer axis of the
  stacked leaves, rows or columns of the others): each process needs half
  of every leaf.
- ``layout="replicate"``: every leaf replicated over "proc" (split over
  "model" only): each process holds all of it; on an object store the load
  reads each leaf once over the processes (read once) and all-gathers.

Each process reports a ``Result``: the ``load`` (what it raised, how long
it took) and, if it loaded, ``Loaded``: ``bytes_read`` and
``rows_fetched`` (the boxes asked and the whole rows fetched,
readcount.ReadCounter), ``fetched`` (bytes TensorStore's kvstore drivers
read, storemeter: headers included), ``peak`` (the byte limiter's most in
use) and ``bad`` (leaves not bit-exact or not in the target's sharding).
With ``config["bad_process"]`` that process loads a source that does not
exist (with ``config["other_process"]``, ``config["other_src"]``: another
valid one).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.restore import readcount
from ckpt.store import storemeter
from tests.hf import llama
from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome


@dataclasses.dataclass(frozen=True)
class Loaded:
  bad: list[str]       # leaves not bit-exact or not in the target's sharding
  bytes_read: int      # the boxes asked
  rows_fetched: int    # the whole rows fetched
  fetched: int         # what the kvstore drivers read
  peak: int            # the byte limiter's most in use


@dataclasses.dataclass(frozen=True)
class Result:
  process: int
  load: Outcome          # load_safetensors (its value: None)
  loaded: Loaded | None  # None if it raised
  total: int             # the model's bytes


def specs(layout: str, path: str, ndim: int) -> P:
  if layout == "replicate":
    return P(*([None] * (ndim - 1)), "model")
  if path.startswith("params/layers/"):
    return P("proc", *([None] * (ndim - 2)), "model")
  if path == "params/lm_head/kernel":  # (hidden, vocab) = HF's rows
    return P(None, ("proc", "model"))
  if path == "params/embed/embedding":  # (vocab, hidden): HF's columns
    return P(None, ("proc", "model"))
  return P("proc")


def run(conf: dict) -> Result:
  me, n = jax.process_index(), jax.process_count()
  mesh = Mesh(np.array(jax.devices()).reshape(n, -1), ("proc", "model"))
  want = llama.expected(llama.tensors(seed=conf["seed"]))
  tgt = llama.nested({
      p: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
          mesh, specs(conf["layout"], p, v.ndim))) for p, v in want.items()})
  total = sum(v.nbytes for v in want.values())
  src = conf["src"]
  if conf.get("bad_process") == me:
    src = src.rstrip("/") + "-missing"
  if conf.get("other_process") == me:  # a copy: valid, but another source
    src = conf["other_src"]
  counter = readcount.ReadCounter()
  readcount.COUNTER.set(counter)
  meter = storemeter.Meter()

  def load():
    with meter:
      return ckpt.load_safetensors(
          src, target=tgt, names=llama.NAMES,
          concurrent_bytes=conf.get("budget", 1 << 30))
  loading = worker.timed(load)
  if not loading.ok:
    return Result(me, loading, None, total)
  got = loading.value
  bad = []
  flat = {"/".join(k.key for k in p): v
          for p, v in jax.tree_util.tree_flatten_with_path(got)[0]}
  for path, arr in flat.items():
    if arr.sharding.spec != specs(conf["layout"], path, arr.ndim):
      bad.append(f"{path}: sharding {arr.sharding}")
    for shard in arr.addressable_shards:
      if not np.array_equal(np.asarray(shard.data), want[path][shard.index]):
        bad.append(f"{path}: shard {shard.index} differs")
  return Result(me, Outcome(None, loading.seconds), Loaded(
      bad, counter.bytes_read, counter.chunk_bytes_read, meter.value,
      counter.peak_in_use), total)


if __name__ == "__main__":
  worker.main(run)
