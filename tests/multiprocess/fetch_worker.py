"""One process of the read-once fetch tests: what a read-once restore
fetches from the store, counted at the store
(tests/objectstore/test_readonce_fetch.py on S3 and GCS,
tests/multiprocess/test_readonce_fetch.py on a disk).

SPMD, P processes x 2 devices: the mesh ("data", "model") has shape (P, 2);
"data" spans the processes, "model" is the two devices of one process.
Every leaf of LEAVES is saved with its save spec (as step 1, chunks cut
towards ``chunk_bytes``) and restored onto its restore spec, which never
uses "data": each leaf is held whole by R = P replica processes. The
shapes do not divide evenly by R or by their chunks (see LEAVES).

config: ``dir``, ``format``, ``chunk_bytes``, ``policies`` (read_once of
each restore, in order), ``scale`` (leaf sizes times this along dim 0;
odd: an even one is rounded up), ``count_url`` (a counting proxy,
tests/objectstore/proxy.py, in front of the store: after the save, and
after each restore once every process is done with it, process 0 marks
``saved`` / ``<i>-<policy>``), ``copies``
(a disk: process 0 copies the saved root once per process, and each
process restores from its own copy, ``restore(path=...)``, as hosts with
their own disks do: processes of one machine share its page cache, so a
chunk another process read would not reach the disk again; before each
restore process 0 writes back and drops every copy's pages from the page
cache, and each process reports the bytes it read from the block device
during the restore, /proc/self/io ``read_bytes``: what its disk served,
counted by the kernel).

Each process reports a ``Result``: per restore ``<i>-<policy>`` a
``Record``: ``stats`` (``last_restore_stats``), ``bad`` (leaves not
bit-exact or not in the target's sharding), and with ``copies``
``read_bytes``; then the same for each of ``cases`` (``run_case``: more
read-once restores, not counted).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

from tests.multiprocess import worker

# name: (shape, dtype, save spec, restore spec). With chunk_bytes 64 KiB:
LEAVES = {
    # 245025 = 3^4 5^2 11^2 elements, saved by every process: 27 chunks of
    # 9075; divides by no replica count (before: not read once at all).
    "odd1d": ((245025,), "float32", (), ()),
    # 999 rows (3^3 37), each process's model half in chunks of 111 rows
    # (before: not read once, no dimension divides by R).
    "odd2d": ((999, 130), "float32", (None, "model"), (None, "model")),
    # Saved cut on dim 1 over every device, chunks (40, 6 or 12, 66):
    # each chunk straddles the two devices (model halves) of one process.
    "cross3d": ((40, 48, 66), "float32", (None, ("data", "model")),
                (None, None, "model")),
    # One chunk, fewer than the readers (before: split into R parts inside
    # it, so every reader fetched it).
    "tiny": ((3000,), "float32", (), ()),
    # Divides by everything, chunks (64, 250) on the saved rows: before,
    # read once on chunk boundaries, but each chunk straddles the model
    # halves.
    "rows": ((1024, 250), "float32", ("data",), (None, "model")),
    # Other widths, summed as 8- and 16-bit integers: one chunk of bools,
    # bfloat16 in one chunk per model half.
    "flags": ((1001, 7), "bool", (), ()),
    "half": ((555, 66), "bfloat16", (None, "model"), (None, "model")),
}


def truth(name, shape, dtype):
  import numpy as np
  import jax.numpy as jnp
  rng = np.random.default_rng(sum(map(ord, name)))
  data = rng.standard_normal(shape, dtype=np.float32)
  if dtype == "bool":
    return data > 0
  return data.astype(jnp.dtype(dtype))


def ts_fetched() -> int:
  """Bytes TensorStore's base kvstore drivers read in this process so far
  (its own counters, whatever ckpt version runs: scripts/bench.py)."""
  import tensorstore as ts
  return sum(int(v.get("value", 0)) for m in
             ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
             if m["name"].endswith("/bytes_read") and "/ocdbt/" not in m["name"]
             for v in m["values"])


def read_bytes() -> int:
  """Bytes this process made the kernel read from a block device."""
  with open("/proc/self/io") as f:
    for line in f:
      if line.startswith("read_bytes:"):
        return int(line.split()[1])
  raise RuntimeError("/proc/self/io has no read_bytes")


def evict(root: str) -> int:
  """Writes back and drops from the page cache every file under ``root``;
  how many."""
  n = 0
  for d, _, files in os.walk(root):
    for name in files:
      fd = os.open(os.path.join(d, name), os.O_RDONLY)
      try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)
      n += 1
  return n


@dataclasses.dataclass(frozen=True)
class Record:
  """One read-once restore."""
  stats: dict[str, Any]             # last_restore_stats, as a dict
  bad: list[str]                    # leaves not bit-exact or misplaced
  ts_fetched: int | None = None     # TensorStore's kvstore bytes read
  read_bytes: int | None = None     # with copies: what the disk served
  splits: dict[str, str] | None = None  # case "lazy": each leaf's split


@dataclasses.dataclass(frozen=True)
class Result:
  process: int
  restores: dict[str, Record]   # by "<i>-<policy>"
  cases: dict[str, Record]      # by case
  evicted: int | None = None    # with copies, on process 0: pages dropped


def run(conf: dict) -> Result:
  # Read once is about arrays: every leaf here is one, none packed (packed
  # leaves of <= 64 KiB are read by each process that needs them).
  from ckpt.save import pack  # pylint: disable=g-import-not-at-top
  pack.MAX_LEAF_BYTES = 0
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import ckpt
  from ckpt.multihost import process as multihost
  from tests.objectstore import proxy

  scale = int(conf.get("scale", 1))
  scale += 1 - scale % 2  # odd: the shapes stay indivisible by 2, 4, 8
  leaves = {n: ((s[0] * scale,) + s[1:], d, a, b)
            for n, (s, d, a, b) in LEAVES.items()
            if n in conf.get("leaves", LEAVES)}
  nproc = jax.process_count()
  mesh = Mesh(np.array(jax.devices()).reshape(nproc, 2), ("data", "model"))
  opts = dict(format=conf.get("format", "zarr3"), async_save=False,
              chunk_bytes=conf.get("chunk_bytes", 64 << 10),
              concurrent_bytes=conf.get("concurrent_bytes", 1 << 30))
  url = conf.get("count_url")
  me = jax.process_index()
  out: dict[str, Any] = {"process": me, "restores": {}, "cases": {}}
  with ckpt.Checkpointer(conf["dir"], **opts) as ck:
    ck.save(1, make_state(leaves, mesh))
    multihost.barrier("saved")
    if url and me == 0:
      proxy.mark(url, "saved")
    copies = [f"{conf['dir']}-copy{p}" for p in range(nproc)]
    if conf.get("copies") and me == 0:
      for c in copies:
        shutil.copytree(conf["dir"], c)
    multihost.barrier("copied")
    target = {n: jax.ShapeDtypeStruct(s, jnp.dtype(d),
                                      sharding=NamedSharding(mesh, P(*b)))
              for n, (s, d, _, b) in leaves.items()}
    for i, policy in enumerate(conf["policies"]):
      name = f"{i}-{policy}"
      where = {}
      if conf.get("copies"):
        if me == 0:
          out.setdefault("evicted", sum(evict(c) for c in copies))
        multihost.barrier(f"evicted-{name}")
        where = {"path": copies[me]}
      before, fetched = read_bytes(), ts_fetched()
      got = ck.restore(1, target=target, read_once=policy, **where)
      during, fetched = read_bytes() - before, ts_fetched() - fetched
      multihost.barrier(f"restored-{name}")
      if url and me == 0:
        proxy.mark(url, name)
      out["restores"][name] = Record(
          dataclasses.asdict(ck.last_restore_stats),
          check(leaves, got, target), fetched,
          during if conf.get("copies") else None)
      del got
      multihost.barrier(f"checked-{name}")
    for case in conf.get("cases", ()):
      out["cases"][case] = run_case(case, conf, opts, ck, leaves, target,
                                    mesh)
      multihost.barrier(f"case-{case}")
  return Result(**out)


def make_state(leaves, mesh):
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  return {n: jax.make_array_from_callback(
      s, NamedSharding(mesh, P(*a)), lambda i, n=n, s=s, d=d: truth(
          n, s, d)[i]) for n, (s, d, a, _) in leaves.items()}


def check(leaves, got, target, dtype=None) -> list[str]:
  """Leaves of ``got`` not in the target's sharding or not bit-exact (with
  the truth cast to ``dtype`` where floating)."""
  import numpy as np
  bad = []
  for n, (s, d, _, _) in leaves.items():
    want = truth(n, s, d)
    if dtype is not None and want.dtype.kind == "f":
      want = want.astype(dtype)
    a = got[n]
    if a.sharding != target[n].sharding:
      bad.append(f"{n}: sharding {a.sharding}")
    if a.dtype != want.dtype:
      bad.append(f"{n}: dtype {a.dtype}, want {want.dtype}")
    bad += [f"{n}: shard {sh.index} differs" for sh in a.addressable_shards
            if np.asarray(sh.data).tobytes() != want[sh.index].tobytes()]
  return bad


def run_case(case, conf, opts, ck, leaves, target, mesh) -> dict:
  """More read-once restores of step 1, checked bit-exact: ``verify``
  (verify=True: each process checks the chunks it reads), ``lazy``
  (lazy=True, the leaves read later: two one by one, the others
  overlapping), ``bf16`` (restore_dtype bfloat16: read as bfloat16, summed
  as 16-bit integers), ``batches`` (a concurrent_bytes that cuts the
  exchange into batches), ``ocdbt`` and ``zarr`` (the state saved again in
  that format, and restored)."""
  import asyncio
  import jax.numpy as jnp
  import ckpt

  def record(ckptr, got, dtype=None) -> Record:
    return Record(dataclasses.asdict(ckptr.last_restore_stats),
                  check(leaves, got, target, dtype))
  if case == "verify":
    return record(ck, ck.restore(1, target=target, read_once=True,
                                 verify=True))
  if case == "lazy":
    got = ck.restore(1, target=target, read_once=True, lazy=True)
    names = list(leaves)
    plans = [type(getattr(got[n].read_once, "split", None)).__name__
             if got[n].read_once is not None else None for n in names]
    arrays = {n: got[n].read() for n in names[:2]}

    async def rest():
      return await asyncio.gather(*(got[n].read_async() for n in names[2:]))
    arrays.update(zip(names[2:], asyncio.run(rest())))
    return dataclasses.replace(record(ck, arrays),
                               splits=dict(zip(names, plans)))
  if case == "bf16":
    with ckpt.Checkpointer(conf["dir"], **opts,
                           restore_dtype=jnp.bfloat16) as ck2:
      got = ck2.restore(1, target=target, read_once=True)
      return record(ck2, got, jnp.bfloat16)
  if case == "batches":
    with ckpt.Checkpointer(conf["dir"], **{
        **opts, "concurrent_bytes": BATCH_BYTES}) as ck2:
      got = ck2.restore(1, target=target, read_once=True)
      return record(ck2, got)
  if case in ("ocdbt", "zarr"):
    with ckpt.Checkpointer(f"{conf['dir']}-{case}", **{
        **opts, "format": case}) as ck2:
      ck2.save(1, make_state(leaves, mesh))
      got = ck2.restore(1, target=target, read_once=True)
      return record(ck2, got)
  raise ValueError(f"unknown case {case!r}")


# The ``batches`` case's concurrent_bytes: several exchange batches. Each
# leaf's cost per process (scale 1; whole chunks: its buffers and result,
# 2 x its boxes on the 2 devices) fits alone: odd1d 3.9 MB, rows 2.0 MB,
# odd2d and cross3d 1.0 MB each, the others less; all together 8.3 MB.
BATCH_BYTES = 4 << 20


if __name__ == "__main__":
  worker.main(run)
