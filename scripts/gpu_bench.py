"""Issue 37.6: a sharded state on a GPU, ckpt against Orbax and plain files.

Run on a machine with a GPU (``python -m scripts.gpu_bench --gib 4``):

- the limits: device-to-host (``jax.device_get`` of every leaf) and
  host-to-device (``jax.device_put`` of the same bytes) throughput;
- async save: how long ``save()`` blocked the caller and how long until the
  step was on disk, for ckpt (``Checkpointer(async_save=True)``) and Orbax
  (``StandardCheckpointer``, async by default), with ckpt's own stage figures;
- restore onto the same shardings (host-to-device included: each restore
  returns when its arrays are on the GPU), ckpt and Orbax, and plain files
  (``np.fromfile`` + ``device_put``) as the limit;
- each round rotates which system goes first; with ``--cold`` the page cache
  is dropped before each restore (needs root).

The state: ``--leaves`` float32 arrays of random data (generated on the GPU),
each sharded over every local device by rows (one GPU: one shard each).
Prints one JSON line per measurement and a summary table at the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import statistics
import tempfile
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from scripts.benchlib import measure


def _state(gib: float, leaves: int, sharding):
  rows = 4096
  cols = int(gib * (1 << 30) / leaves / 4 / rows)
  key = jax.random.key(0)
  out = {}
  for i in range(leaves):
    key, sub = jax.random.split(key)
    make = jax.jit(lambda k: jax.random.normal(k, (rows, cols), jnp.float32),
                   out_shardings=sharding)
    out[f"layer{i:03d}"] = make(sub)
  jax.block_until_ready(out)
  return out


def _fresh(state):
  """A copy made on the device: a jax.Array caches its host value after
  its first device-to-host copy, so every system (and every limit) gets
  arrays never copied to the host before."""
  out = {k: v.copy() for k, v in state.items()}
  jax.block_until_ready(out)
  return out


def _drop_caches(cold: bool) -> None:
  if not cold:
    return
  if not measure.drop_page_cache():
    raise SystemExit("--cold needs root (/proc/sys/vm/drop_caches)")


_FAULTS = [0]


def _emit(rows: list, **row) -> None:
  """One measurement; ``faults``: minor page faults since the last one;
  ``rss_mib``: the process's resident memory now (pinned staging buffers
  that XLA keeps pooled between saves count here)."""
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  row["faults"], _FAULTS[0] = faults - _FAULTS[0], faults
  row["rss_mib"] = round(measure.rss() / 2**20)
  print(json.dumps(row), flush=True)
  rows.append(row)


def _ckpt_round(root, state, target, rows, cold, budget=None, name="ckpt",
                pinned=True):
  """``budget``: concurrent_bytes (None: ckpt's default, 1 GiB: an async
  save of a larger state then blocks until what is beyond the budget is
  written; the state's size: staged whole, as Orbax does). ``pinned``:
  ``ckpt.save.staging.PINNED_STAGING`` for this round's save."""
  import ckpt  # pylint: disable=g-import-not-at-top
  from ckpt.save import staging  # pylint: disable=g-import-not-at-top
  path = os.path.join(root, name)
  opts = {} if budget is None else {"concurrent_bytes": budget}
  staging.PINNED_STAGING = pinned
  try:
    with ckpt.Checkpointer(path, async_save=True, **opts) as c:
      t0 = time.perf_counter()
      c.save(1, state)
      blocked = time.perf_counter() - t0
      c.wait_until_finished()
      total = time.perf_counter() - t0
      st = c.last_save_stats
  finally:
    staging.PINNED_STAGING = True
  _emit(rows, system=name, what="save", blocking_s=blocked, total_s=total,
        pinned=pinned,
        stats_blocking_s=st.blocking_s, bytes=st.bytes_written)
  # The verified restore first (the figure compared with the others: the
  # first restore after the save), then an unverified one (warmer).
  result = None
  for verify in (True, False):
    _drop_caches(cold)
    with ckpt.Checkpointer(path, **opts) as c:
      t0 = time.perf_counter()
      out = c.restore(1, target=target, verify=verify)
      jax.block_until_ready(out)
      total = time.perf_counter() - t0
      rs = c.last_restore_stats
    _emit(rows, system=name, what="restore" if verify else "restore_noverify",
          total_s=total, stages=rs.stages_text())
    if verify:
      result = out
    del out
  shutil.rmtree(path)
  return result


def _orbax_round(root, state, target, rows, cold):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = os.path.join(root, "orbax", "1")
  c = ocp.StandardCheckpointer()
  t0 = time.perf_counter()
  c.save(path, state)
  blocked = time.perf_counter() - t0
  c.wait_until_finished()
  total = time.perf_counter() - t0
  c.close()
  _emit(rows, system="orbax", what="save", blocking_s=blocked, total_s=total)
  _drop_caches(cold)
  with ocp.StandardCheckpointer() as c:
    t0 = time.perf_counter()
    out = c.restore(path, target)
    jax.block_until_ready(out)
    total = time.perf_counter() - t0
  _emit(rows, system="orbax", what="restore", total_s=total)
  shutil.rmtree(os.path.join(root, "orbax"))
  return out


def _raw_round(root, state, target, rows, cold):
  """One file per leaf: device_get, tofile, fsync; fromfile, device_put."""
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  path = os.path.join(root, "raw")
  os.makedirs(path)
  t0 = time.perf_counter()
  host = jax.device_get(state)
  d2h = time.perf_counter() - t0

  def write(item):
    name, arr = item
    with open(os.path.join(path, name), "wb") as f:
      arr.tofile(f)
      f.flush()
      os.fsync(f.fileno())

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    list(pool.map(write, host.items()))
  fd = os.open(path, os.O_RDONLY)
  os.fsync(fd)
  os.close(fd)
  total = time.perf_counter() - t0
  _emit(rows, system="raw", what="save", blocking_s=d2h, total_s=total)
  del host
  _drop_caches(cold)

  def read(name):
    t = target[name]
    return np.fromfile(os.path.join(path, name), t.dtype).reshape(t.shape)

  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    host = dict(zip(target, pool.map(read, target)))
  out = {k: jax.device_put(v, target[k].sharding) for k, v in host.items()}
  jax.block_until_ready(out)
  total = time.perf_counter() - t0
  _emit(rows, system="raw", what="restore", total_s=total)
  shutil.rmtree(path)
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gib", type=float, default=4.0)
  ap.add_argument("--leaves", type=int, default=32)
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--cold", action="store_true")
  ap.add_argument("--dir", default=None)
  ap.add_argument("--systems", default="ckpt,orbax,raw",
                  help="ckpt (concurrent_bytes = the state's size), ckpt1g "
                  "(ckpt's default budget, 1 GiB), ckptpage (as ckpt, staged "
                  "in pageable memory, not pinned), orbax, raw")
  ap.add_argument("--huge-pages", choices=("auto", "on", "off"),
                  default="auto", help="ckpt.restore.hostmem.HUGE_PAGES")
  args = ap.parse_args(argv)
  from ckpt.restore import hostmem  # pylint: disable=g-import-not-at-top
  from ckpt.save import polite  # pylint: disable=g-import-not-at-top
  # An async save drops the pages it wrote from the page cache (polite.py:
  # a checkpoint is not read back by the job that wrote it); here every
  # system's restore reads what it just saved, so all of them read from the
  # same cache state: warm, or with --cold every cache dropped.
  polite.DROP_WRITTEN_PAGES = False
  hostmem.HUGE_PAGES = {"auto": None, "on": True, "off": False}[
      args.huge_pages]
  print(json.dumps({"huge_pages": args.huge_pages,
                    "balloon_reports_free_pages":
                    hostmem.reports_huge_pages()}), flush=True)

  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  print(json.dumps({"devices": [str(d) for d in devices],
                    "jax": jax.__version__}), flush=True)
  state = _state(args.gib, args.leaves, sharding)
  nbytes = sum(x.nbytes for x in state.values())
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
            for k, v in state.items()}
  rows: list = []
  # The limits.
  for _ in range(3):
    fresh = _fresh(state)
    t0 = time.perf_counter()
    host = jax.device_get(fresh)
    d2h = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = jax.device_put(host, sharding)
    jax.block_until_ready(back)
    h2d = time.perf_counter() - t0
    _emit(rows, system="limit", what="d2h_h2d", d2h_s=d2h, h2d_s=h2d,
          d2h_gbps=nbytes / d2h / 1e9, h2d_gbps=nbytes / h2d / 1e9)
    del host, back, fresh

  runs = {"ckpt": functools.partial(_ckpt_round, budget=nbytes + (64 << 20)),
          "ckpt1g": functools.partial(_ckpt_round, name="ckpt1g"),
          "ckptpage": functools.partial(_ckpt_round, budget=nbytes + (64 << 20),
                                        name="ckptpage", pinned=False),
          "orbax": _orbax_round, "raw": _raw_round}
  systems = args.systems.split(",")
  root = tempfile.mkdtemp(dir=args.dir, prefix="gpu_bench.")
  try:
    for r in range(args.rounds):
      order = systems[r % len(systems):] + systems[:r % len(systems)]
      for name in order:
        try:
          out = runs[name](root, _fresh(state), target, rows, args.cold)
        except Exception as e:  # pylint: disable=broad-except
          # One system failing (another JAX or Orbax version there) must
          # not lose the figures of the others.
          _emit(rows, system=name, what="error", round=r, error=repr(e))
          shutil.rmtree(os.path.join(root, name), ignore_errors=True)
          continue
        ok = all(bool(jnp.array_equal(out[k], state[k])) for k in state)
        _emit(rows, system=name, what="check", round=r, equal=ok)
        del out
  finally:
    shutil.rmtree(root, ignore_errors=True)

  print(f"\nstate: {nbytes / 2**30:.2f} GiB in {args.leaves} leaves on "
        f"{len(devices)} device(s) ({devices[0].device_kind}); "
        f"{'cold' if args.cold else 'warm'} page cache; medians of "
        f"{args.rounds} rotated rounds")
  lim = [x for x in rows if x["system"] == "limit"]
  print(f"limit: device->host {min(x['d2h_s'] for x in lim):.3f} s "
        f"({max(x['d2h_gbps'] for x in lim):.1f} GB/s), host->device "
        f"{min(x['h2d_s'] for x in lim):.3f} s "
        f"({max(x['h2d_gbps'] for x in lim):.1f} GB/s)")
  print("| system | save blocks (s) | save total (s) | save GB/s | "
        "restore (s) | restore GB/s |")
  print("|---|---|---|---|---|---|")
  for name in systems:
    sv = [x for x in rows if x["system"] == name and x["what"] == "save"]
    rs = [x for x in rows if x["system"] == name and x["what"] == "restore"]
    if not sv or not rs:
      print(f"| {name} | failed | | | | |")
      continue
    b = statistics.median(x["blocking_s"] for x in sv)
    t = statistics.median(x["total_s"] for x in sv)
    r = statistics.median(x["total_s"] for x in rs)
    nv = [x["total_s"] for x in rows
          if x["system"] == name and x["what"] == "restore_noverify"]
    unverified = f" (unverified {statistics.median(nv):.3f})" if nv else ""
    print(f"| {name} | {b:.3f} | {t:.3f} | {nbytes / t / 1e9:.2f} | "
          f"{r:.3f}{unverified} | {nbytes / r / 1e9:.2f} |")


if __name__ == "__main__":
  main()
