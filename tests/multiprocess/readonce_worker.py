"""One process of the read-once restore tests (tests/multiprocess/test_readonce.py
and tests/objectstore/test_readonce.py).

SPMD, 4 processes x 2 devices (or any P x 2): the mesh ("a", "b", "c") has
shape (P/2, 2, 2); "a" and "b" span processes, "c" is the two devices of one
process. Each process builds the same global arrays from fixed seeds.

- ``save``: the state, fully sharded on dim 0 over every device, saved as
  step 1 (``chunk_bytes`` small so chunks align with every restore box).
- ``both``: save, then restore, in one launch.
- ``restore``: restores step 1 onto TARGET specs (leaves replicated over 4
  processes, over 2, fully sharded, an inline scalar), once per entry of
  ``config["policies"]`` (read_once True / False / None), and reports per
  policy: ``last_restore_stats``, whether every addressable shard is
  bit-exact with the global arrays and has exactly the target's sharding
  (the policies in ``config["verify"]`` restore with ``verify=True``);
  with ``config["moto_log"]`` process 0 also counts moto's GET requests of
  chunk keys made during that restore (all processes), from its access log;
  with ``config["count_url"]`` (a counting proxy, tests/objectstore/proxy.py)
  it marks ``start`` before the first restore and ``<i>-<policy>`` after
  each; ``ts_fetched``: the bytes TensorStore's kvstore drivers read in the
  process during the restore.
- ``config["cases"]``: more read-once restores of the same step, each
  reported under its name with the same checks (``run_case``): ``lazy``
  (``lazy=True`` leaves read later, read once on and off), ``dtype``
  (``restore_dtype`` bfloat16), ``fallback`` (a rename transform and a
  fallback leaf), ``batches`` (a tiny ``concurrent_bytes``: several exchange
  batches), ``ocdbt`` (the state saved again in format "ocdbt" and
  restored).
- ``fail_on``: a restore whose transform raises on that process only, then
  a lazy read-once read whose step guard raises on that process only, then
  one cancelled on that process only after it started; each must fail on
  every process, and the next read work.
- ``corrupt`` (format "zarr", on a disk): process 0 flips one byte of a
  chunk of rep4/w, then every process restores read once without and with
  ``verify=True`` (the crc32c of each box, from the per-process checksum
  files) and reports the error or whether rep4/w came back exact.

Each process returns a ``Result`` (tests/multiprocess/worker.py): a
``Record`` per restore (by policy, ``lazy-<policy>`` or case), the
``Failures`` of ``fail_on`` and the ``Corrupt`` outcomes by ``verify``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import time
from typing import Any

from tests.multiprocess import worker
from tests.multiprocess.worker import Error, Outcome

SHAPES = {
    # name: (shape, dtype, restore spec)
    "rep4/w": ((1024, 256), "float32", (None, "c")),
    "rep4/all": ((512, 128), "float32", ()),
    "rep4/i": ((256, 256), "int32", ("c", None)),
    "rep2/w": ((1024, 256), "float32", ("a", "c")),
    "shard/w": ((1024, 256), "float32", (("a", "b"), "c")),
}
CHUNK_BYTES = 32 << 10
_GET_RE = re.compile(r'"GET (\S+) HTTP/[0-9.]+" (\d{3})')
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


@dataclasses.dataclass(frozen=True)
class OtherSharding:
  """A lazy leaf bound to read once, read with another sharding (P(), on
  process 0 alone): what that read added to the stats, and whether exact."""
  bytes: int
  exchanged: int
  exact: bool


@dataclasses.dataclass(frozen=True)
class Record:
  """One restore of step 1 (a policy's, a lazy one's, a case's)."""
  stats: dict[str, Any]               # last_restore_stats, as a dict
  bad: list[str]                      # leaves not bit-exact or misplaced
  ts_fetched: int | None = None       # a policy's: TensorStore's bytes read
  moto_gets: int | None = None        # a policy's, process 0: chunk GETs
  before: int | None = None           # lazy: bytes the restore call read
  read_once: list[str] | None = None  # lazy: the leaves bound to read once
  other_sharding: OtherSharding | None = None  # lazy-True, process 0


@dataclasses.dataclass(frozen=True)
class Order:
  """Two lazy leaves read once, in another order on each process: each
  read (its value: the leaf's problems), then both in the same order."""
  got: list[Outcome]
  again: list[list[str]]


@dataclasses.dataclass(frozen=True)
class Failures:
  """``fail_on``: each read that fails on one process only (see the module
  docstring), and the read after it."""
  fail: Error | None                # a transform raising there
  after_fail: int                   # the next restore's "step" leaf
  lazy_fail: Error | None           # a lazy read whose guard raises there
  lazy_cancel: Outcome              # "cancelled" on that process
  lazy_after_fail: list[str]        # the next lazy read's problems
  lazy_after_fail_stats: dict[str, Any]
  lazy_order: dict[str, Order]      # by the second leaf of the pair


@dataclasses.dataclass(frozen=True)
class Corrupt:
  """A read-once restore after a flipped byte: its error, or whether
  rep4/w came back exact."""
  error: Error | None
  exact: bool | None = None


@dataclasses.dataclass(frozen=True)
class Result:
  process: int
  saved: bool = False
  restores: dict[str, Record] = dataclasses.field(default_factory=dict)
  failures: Failures | None = None
  corrupt: dict[str, Corrupt] | None = None  # by verify ("False", "True")


def truth(name, shape, dtype):
  import numpy as np
  rng = np.random.default_rng(abs(hash(name)) % (1 << 31) if False else
                              sum(map(ord, name)))
  if dtype == "int32":
    return rng.integers(-2**31, 2**31 - 1, shape, dtype=np.int32)
  return rng.standard_normal(shape, dtype=np.float32)


def ts_fetched() -> int:
  """Bytes TensorStore's base kvstore drivers read in this process so far
  (its own counters, whatever ckpt version runs)."""
  import tensorstore as ts
  return sum(int(v.get("value", 0)) for m in
             ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
             if m["name"].endswith("/bytes_read") and "/ocdbt/" not in m["name"]
             for v in m["values"])


def moto_gets(log_path: str, offset: int) -> int:
  """GETs of chunk objects (not index, metadata or listings) after offset."""
  size, since = -1, time.monotonic()
  while time.monotonic() - since < 0.5:  # moto logs after answering
    if os.path.getsize(log_path) != size:
      size, since = os.path.getsize(log_path), time.monotonic()
    time.sleep(0.05)
  with open(log_path, "rb") as f:
    f.seek(offset)
    text = _ANSI_RE.sub("", f.read().decode(errors="replace"))
  n = 0
  for m in _GET_RE.finditer(text):
    last = m.group(1).partition("?")[0].rsplit("/", 1)[-1]
    # zarr v2 chunk keys: "0.1"; zarr3: ".../c/0/1" (last part a number).
    # (not the commit records, "commits/<step>").
    if m.group(2) in ("200", "206") and re.fullmatch(
        r"\d+(\.\d+)*", last) and "/commits/" not in m.group(1):
      n += 1
  return n


def run(conf: dict) -> Result:
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import ckpt
  from ckpt.multihost import process as multihost

  scale = int(conf.get("scale", 1))  # scripts/bench.py: bigger leaves
  for n, (shape, d, spec) in list(SHAPES.items()):
    SHAPES[n] = ((shape[0] * scale,) + shape[1:], d, spec)
  nproc = jax.process_count()
  devs = np.array(jax.devices()).reshape(nproc // 2, 2, 2)
  mesh = Mesh(devs, ("a", "b", "c"))
  opts = dict(format=conf.get("format", "zarr"), async_save=False,
              chunk_bytes=CHUNK_BYTES,
              concurrent_bytes=conf.get("concurrent_bytes", 1 << 30))
  pid = jax.process_index()
  saved, restores, failures, corrupt = False, {}, None, None
  with ckpt.Checkpointer(conf["dir"], **opts) as ck:
    if conf["op"] in ("save", "both"):
      ck.save(1, make_state(mesh))
      saved = True
    if conf["op"] in ("restore", "both"):
      target = _nest({n: jax.ShapeDtypeStruct(
          s, np.dtype(d), sharding=NamedSharding(mesh, P(*spec)))
                      for n, (s, d, spec) in SHAPES.items()})
      target["step"] = 0
      count_url = conf.get("count_url")  # scripts/bench.py: a counting proxy
      if count_url and pid == 0:
        from tests.objectstore import proxy  # pylint: disable=g-import-not-at-top
        proxy.mark(count_url, "start")
      for i, policy in enumerate(conf["policies"]):
        multihost.barrier(f"before-{policy}")
        log = conf.get("moto_log")
        offset = os.path.getsize(log) if log else 0
        fetched = ts_fetched()
        got = ck.restore(1, target=target, read_once=policy,
                         verify=policy in conf.get("verify", ()))
        fetched = ts_fetched() - fetched
        multihost.barrier(f"after-{policy}")
        if count_url and pid == 0:
          proxy.mark(count_url, f"{i}-{policy}")
        bad = [b for n in SHAPES for b in check_leaf(leaf_of(got, n), n, mesh)]
        if got["step"] != 7:
          bad.append(f"step {got['step']}")
        gets = moto_gets(log, offset) if log and pid == 0 else None
        multihost.barrier(f"counted-{policy}")
        # A repeated policy: the last (warm) one.
        restores[str(policy)] = Record(
            dataclasses.asdict(ck.last_restore_stats), bad,
            ts_fetched=fetched, moto_gets=gets)
      for case in conf.get("cases", ()):
        multihost.barrier(f"before-{case}")
        restores.update(run_case(case, conf, opts, ck, mesh, target))
        multihost.barrier(f"after-{case}")
    if "fail_on" in conf:  # one process fails before the exchange
      failures = fail_on(conf["fail_on"], ck, mesh, target)
    if conf.get("corrupt"):  # format "zarr" on a disk: a flipped byte
      multihost.barrier("before-corrupt")
      if pid == 0:
        path = os.path.join(conf["dir"], "checkpoint_1", "rep4", "w", "0.0")
        with open(path, "r+b") as f:
          f.seek(os.path.getsize(path) // 2)
          byte = f.read(1)
          f.seek(-1, os.SEEK_CUR)
          f.write(bytes([byte[0] ^ 0x40]))
      multihost.barrier("after-corrupt")
      corrupt = {}
      for verify in (False, True):
        try:
          got = ck.restore(1, target=target, read_once=True, verify=verify)
          corrupt[str(verify)] = Corrupt(None, check_leaf(
              leaf_of(got, "rep4/w"), "rep4/w", mesh) == [])
        except Exception as e:  # pylint: disable=broad-except
          corrupt[str(verify)] = Corrupt(Error.of(e))
        multihost.barrier(f"after-corrupt-{verify}")
  return Result(pid, saved, restores, failures, corrupt)


def fail_on(bad_pid: int, ck, mesh, target) -> Failures:
  """``fail_on``: reads that fail on process ``bad_pid`` only (see the
  module docstring); each must fail on every process, the next work."""
  import jax
  pid = jax.process_index()

  def boom(ckpt_tree, target_tree, *, is_resuming):
    del target_tree, is_resuming
    if pid == bad_pid:
      raise ValueError("boom on this process")
    return ckpt_tree
  fail = worker.timed(lambda: ck.restore(1, target=target, read_once=True,
                                         transforms=(boom,))).error
  after_fail = ck.restore(1, target=target, read_once=True)["step"]
  # A lazy leaf read once, whose read fails on that process only (its
  # step guard raises there): every process raises; the next read works.
  lz = ck.restore(1, target=target, read_once=True, lazy=True)
  leaf = lz["rep4"]["w"]
  if pid == bad_pid:
    def gone():
      raise ValueError("step gone on this process")
    leaf.guard = gone
  lazy_fail = worker.timed(leaf.read).error
  # A lazy read-once read cancelled on that process only, after it has
  # taken its round (readonce.LazyRounds.abandon): the others raise
  # instead of waiting for a process that never joins.
  other = lz["rep4"]["i"]
  if pid == bad_pid:
    async def cancelled():
      task = asyncio.ensure_future(other.read_async())
      await asyncio.sleep(0)  # it has started: its round is taken
      task.cancel()
      try:
        await task
      except asyncio.CancelledError:
        return "cancelled"
      return "finished"
    lazy_cancel = worker.timed(lambda: asyncio.run(cancelled()))
  else:
    lazy_cancel = worker.timed(
        lambda: check_leaf(other.read(), "rep4/i", mesh))
  lazy_after_fail = check_leaf(lz["rep4"]["all"].read(), "rep4/all", mesh)
  lazy_after_fail_stats = dataclasses.asdict(ck.last_restore_stats)
  # Lazy read-once reads in another order on each process (same shape
  # and dtype; then different ones): every read raises on every process,
  # naming both leaves, never mixing them; the same order then works.
  orders = {}
  for pair in (("rep4/w", "rep2/w"), ("rep4/w", "rep4/i")):
    lz = ck.restore(1, target=target, read_once=True, lazy=True)
    order = pair if pid == 0 else pair[::-1]
    got = [worker.timed(lambda n=name: check_leaf(
        leaf_of(lz, n).read(), n, mesh)) for name in order]
    again = [check_leaf(leaf_of(lz, n).read(), n, mesh) for n in pair]
    orders[pair[1]] = Order(got, again)
  return Failures(fail, after_fail, lazy_fail, lazy_cancel, lazy_after_fail,
                  lazy_after_fail_stats, orders)


# The ``batches`` case's concurrent_bytes: 4 processes cut the 4 read-once
# leaves (exchange costs per process, in tree order: rep2/w 768 KiB,
# rep4/all 640 KiB, rep4/i 320 KiB, rep4/w 1.25 MiB) into 3 batches, the
# largest 1.375 MiB.
BATCH_BYTES = 1536 << 10


def make_state(mesh):
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  full = NamedSharding(mesh, P(("a", "b", "c")))
  state = _nest({n: jax.make_array_from_callback(
      s, full, lambda i, n=n, s=s, d=d: truth(n, s, d)[i])
                 for n, (s, d, _) in SHAPES.items()})
  state["step"] = 7
  return state


def leaf_of(tree, name):
  for part in name.split("/"):
    tree = tree[part]
  return tree


def check_leaf(a, name, mesh, dtype=None) -> list[str]:
  """What is wrong with restored leaf ``name``: its sharding is not the
  target's, its dtype, or a shard not bit-exact with the truth (cast to
  ``dtype`` if floating)."""
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  s, d, spec = SHAPES[name]
  want = truth(name, s, d)
  if dtype is not None and want.dtype.kind == "f":
    want = want.astype(dtype)
  bad = []
  if a.sharding != NamedSharding(mesh, P(*spec)):
    bad.append(f"{name}: sharding {a.sharding}")
  if a.dtype != want.dtype:
    bad.append(f"{name}: dtype {a.dtype}, want {want.dtype}")
  for sh in a.addressable_shards:
    if np.asarray(sh.data).tobytes() != want[sh.index].tobytes():
      bad.append(f"{name}: shard {sh.index} differs")
  return bad


def run_case(case, conf, opts, ck, mesh, target) -> dict[str, Record]:
  """One more read-once restore of step 1 (see the module docstring), by
  its result's name."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  import ckpt
  from ckpt.multihost import process as multihost
  from ckpt.restore import transforms

  def record(ckptr, got, dtype=None, names=None):
    names = names or {n: n for n in SHAPES}
    bad = [b for n, m in names.items()
           for b in check_leaf(leaf_of(got, m), n, mesh, dtype)]
    return Record(dataclasses.asdict(ckptr.last_restore_stats), bad)

  if case == "lazy":
    out = {}
    for policy in (True, False):
      got = ck.restore(1, target=target, read_once=policy, lazy=True)
      stats = ck.last_restore_stats  # grows as the leaves are read
      before = stats.bytes_read
      names = list(SHAPES)
      plans = [n for n in names if leaf_of(got, n).read_once is not None]
      # Two leaves read one by one, the others overlapping (gather of
      # read_async): their collectives still run in call order.
      arrays = {n: leaf_of(got, n).read() for n in names[:2]}

      async def rest():
        return await asyncio.gather(
            *(leaf_of(got, n).read_async() for n in names[2:]))
      arrays.update(zip(names[2:], asyncio.run(rest())))
      bad = [b for n in names for b in check_leaf(arrays[n], n, mesh)]
      read = dataclasses.asdict(stats)
      other = None
      if policy and multihost.process_index() == 0:
        # Another sharding than the one it was bound to: the normal read,
        # not a collective (process 0 alone reads).
        leaf = leaf_of(got, "rep4/i")
        a = leaf.read(NamedSharding(mesh, P()))
        other = OtherSharding(
            bytes=stats.bytes_read - read["bytes_read"],
            exchanged=stats.read_once_leaves - read["read_once_leaves"],
            exact=np.asarray(a.addressable_shards[0].data).tobytes() ==
            truth("rep4/i", *SHAPES["rep4/i"][:2]).tobytes())
      multihost.barrier(f"lazy-{policy}")
      out[f"lazy-{policy}"] = Record(read, bad, before=before,
                                     read_once=plans, other_sharding=other)
    return out
  if case == "dtype":
    with ckpt.Checkpointer(conf["dir"], **opts,
                           restore_dtype=jnp.bfloat16) as ck2:
      got = ck2.restore(1, target=target, read_once=True)
      return {"dtype": record(ck2, got, jnp.bfloat16)}
  if case == "batches":
    with ckpt.Checkpointer(conf["dir"], **{
        **opts, "concurrent_bytes": BATCH_BYTES}) as ck2:
      got = ck2.restore(1, target=target, read_once=True)
      return {"batches": record(ck2, got)}
  if case == "fallback":
    renamed = {n: n.replace("rep4/", "r4/") for n in SHAPES}
    tgt = _nest({renamed[n]: leaf_of(target, n) for n in SHAPES})
    extra = np.arange(512, dtype=np.float32).reshape(64, 8)
    tgt["extra"] = {"v": jax.ShapeDtypeStruct(
        extra.shape, extra.dtype, sharding=NamedSharding(mesh, P(None, "c")))}
    got = ck.restore(1, target=tgt, read_once=True,
                     transforms=(transforms.rename(r"rep4/(.*)", r"r4/\1"),),
                     fallback_state={"extra": {"v": extra}})
    rec = record(ck, got, names=renamed)
    v = got["extra"]["v"]
    if v.sharding != tgt["extra"]["v"].sharding or any(
        not np.array_equal(np.asarray(sh.data), extra[sh.index])
        for sh in v.addressable_shards):
      rec.bad.append("extra/v (the fallback) differs")
    return {"fallback": rec}
  if case == "ocdbt":
    with ckpt.Checkpointer(conf["dir"] + "-ocdbt", **{
        **opts, "format": "ocdbt"}) as ck2:
      ck2.save(1, make_state(mesh))
      got = ck2.restore(1, target=target, read_once=True)
      return {"ocdbt": record(ck2, got)}
  raise ValueError(f"unknown case {case!r}")


def _nest(flat):
  out = {}
  for k, v in flat.items():
    a, b = k.split("/")
    out.setdefault(a, {})[b] = v
  return out


if __name__ == "__main__":
  worker.main(run)
