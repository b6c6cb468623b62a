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
  chunk keys made during that restore (all processes), from its access log.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import json
import time

from ckpt import local_cluster

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


def truth(name, shape, dtype):
  import numpy as np
  rng = np.random.default_rng(abs(hash(name)) % (1 << 31) if False else
                              sum(map(ord, name)))
  if dtype == "int32":
    return rng.integers(-2**31, 2**31 - 1, shape, dtype=np.int32)
  return rng.standard_normal(shape, dtype=np.float32)


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


def main():
  cfg = local_cluster.init_from_env()
  conf = json.loads(sys.argv[1])
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import ckpt
  from ckpt import multihost

  scale = int(conf.get("scale", 1))  # scripts/bench.py: bigger leaves
  for n, (shape, d, spec) in list(SHAPES.items()):
    SHAPES[n] = ((shape[0] * scale,) + shape[1:], d, spec)
  nproc = jax.process_count()
  devs = np.array(jax.devices()).reshape(nproc // 2, 2, 2)
  mesh = Mesh(devs, ("a", "b", "c"))
  opts = dict(format=conf.get("format", "zarr"), async_save=False,
              chunk_bytes=CHUNK_BYTES,
              concurrent_bytes=conf.get("concurrent_bytes", 1 << 30))
  out = {"process": cfg["process_id"]}
  with ckpt.Checkpointer(conf["dir"], **opts) as ck:
    if conf["op"] in ("save", "both"):
      full = NamedSharding(mesh, P(("a", "b", "c")))
      state = {n: jax.make_array_from_callback(
          s, full, lambda i, n=n, s=s, d=d: truth(n, s, d)[i])
               for n, (s, d, _) in SHAPES.items()}
      state = _nest(state)
      state["step"] = 7
      ck.save(1, state)
      out["saved"] = True
    if conf["op"] in ("restore", "both"):
      target = _nest({n: jax.ShapeDtypeStruct(
          s, np.dtype(d), sharding=NamedSharding(mesh, P(*spec)))
                      for n, (s, d, spec) in SHAPES.items()})
      target["step"] = 0
      for policy in conf["policies"]:
        multihost.barrier(f"before-{policy}")
        log = conf.get("moto_log")
        offset = os.path.getsize(log) if log else 0
        got = ck.restore(1, target=target, read_once=policy,
                         verify=policy in conf.get("verify", ()))
        multihost.barrier(f"after-{policy}")
        bad = []
        for n, (s, d, spec) in SHAPES.items():
          a = got
          for part in n.split("/"):
            a = a[part]
          want = truth(n, s, d)
          if a.sharding != NamedSharding(mesh, P(*spec)):
            bad.append(f"{n}: sharding {a.sharding}")
          for sh in a.addressable_shards:
            if not np.array_equal(np.asarray(sh.data), want[sh.index]):
              bad.append(f"{n}: shard {sh.index} differs")
        if got["step"] != 7:
          bad.append(f"step {got['step']}")
        rec = {"stats": dataclasses.asdict(ck.last_restore_stats), "bad": bad}
        if log and cfg["process_id"] == 0:
          rec["moto_gets"] = moto_gets(log, offset)
        multihost.barrier(f"counted-{policy}")
        out[str(policy)] = rec  # a repeated policy: the last (warm) one
    if "fail_on" in conf:  # one process fails before the exchange
      def boom(ckpt_tree, target_tree, *, is_resuming):
        del target_tree, is_resuming
        if cfg["process_id"] == conf["fail_on"]:
          raise ValueError("boom on this process")
        return ckpt_tree
      try:
        ck.restore(1, target=target, read_once=True, transforms=(boom,))
        out["fail"] = None
      except Exception as e:  # pylint: disable=broad-except
        out["fail"] = f"{type(e).__name__}: {e}"
      out["after_fail"] = ck.restore(1, target=target, read_once=True)["step"]
  local_cluster.write_result(out)


def _nest(flat):
  out = {}
  for k, v in flat.items():
    a, b = k.split("/")
    out.setdefault(a, {})[b] = v
  return out


if __name__ == "__main__":
  main()
