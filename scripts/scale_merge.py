"""Scale harness, part "merge": the cost of the OCDBT merge (ckpt/store/ocdbt.py).

With ``format="ocdbt"`` every process writes its own database and process 0
merges them, after the "written" barrier, into the step's database
(``ocdbt.merge``: open every per-process database, copy each B+tree into
one atomic transaction, commit). This part measures that merge alone, on
local disk, in one process, on synthetic steps shaped like a real save:
``K`` leaves, every one sharded over all ``P`` processes, so process ``p``
wrote chunk ``p`` of every leaf into ``ocdbt.process_<p>/`` and process 0
also wrote every leaf's ``zarr.json`` (as ``save.write_owned`` does: one
metadata transaction, one data transaction per process). The merged tree
has ``P * K + K`` keys.

Writer "zarr" writes through TensorStore's zarr3 driver
(``tsspec.array_spec(format="ocdbt")`` over ``ocdbt.process_database``,
exactly the save's path; about 2 ms per chunk here, so slow beyond ~50,000
chunks); writer "kv" (default) writes the same keys and the same bytes
(checked against the zarr driver's output first) straight into each
process's OCDBT kvstore, which is ~100x faster to generate. After each
merge a sample of leaves is read back through the zarr3 driver from the
merged database and compared, and the merged keys are counted.

Per (P, K), medians over ``repeats`` merges, each on a fresh hard-linked
copy of the generated step (the merge only adds files at the step's root):
- merge s: ``ocdbt.merge`` with a fresh context (``Storage.context()``);
- open / copy / commit s: the same three stages timed one by one (a replica
  of ``ocdbt.merge`` on another copy);
- read / written MB and read / write syscalls: ``/proc/self/io`` (rchar,
  wchar, syscr, syscw) over the merge (page cache: the files were just
  written, so reads come from memory);
- peak MB: the kernel's RSS high-water mark during the merge (reset
  before it) above the RSS before it: what the one transaction holds;
- files read / written: distinct files the merge opened (``strace -f -y``
  in a subprocess, when strace exists and ``strace`` is true);
- merged MB / files: what the merge added at the step's root (manifest
  and B+tree nodes), and bytes per merged key.
The extrapolation fits ``t = a + b*P + c*P*K`` (least squares, all points)
and likewise for bytes, and evaluates it at 1,000 processes x 10,000 leaves.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from scripts.benchlib import measure

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULTS: dict[str, Any] = {
    "processes": [16, 64, 256],
    "keys": [10, 100, 1000],     # leaves, each with one chunk per process
    "max_chunks": 300_000,       # skip (P, K) with P * K above this
    "chunk_floats": 64,          # float32 per chunk (256 B: above OCDBT's
                                 # 100-byte inline limit, like real chunks)
    "writer": "kv",
    "repeats": 3,
    "verify_leaves": 8,
    "strace": True,
    "fit": True,
    "extrapolate": [1000, 10000],
    "seed": 0,
    "dir": None,
}
COLUMNS = [
    ("P", "processes", "{:d}"),
    ("K", "keys", "{:d}"),
    ("merged keys", "merged_keys", "{:,d}"),
    ("merge s", "merge_s", "{:.3f}"),
    ("open s", "open_s", "{:.3f}"),
    ("copy s", "copy_s", "{:.3f}"),
    ("commit s", "commit_s", "{:.3f}"),
    ("µs/key", "us_per_key", "{:.1f}"),
    ("read MB", "read_mb", "{:.2f}"),
    ("written MB", "written_mb", "{:.2f}"),
    ("read calls", "read_calls", "{:,d}"),
    ("write calls", "write_calls", "{:,d}"),
    ("peak MB", "peak_mb", "{:.1f}"),
    ("files read", "files_read", "{}"),
    ("files written", "files_written", "{}"),
    ("merged MB", "merged_mb", "{:.2f}"),
    ("merged files", "merged_files", "{:d}"),
    ("B/key", "bytes_per_key", "{:.0f}"),
    ("gen s", "generate_s", "{:.1f}"),
]


# ---- the synthetic step -------------------------------------------------------

def leaf_path(i: int) -> str:
  return f"layer_{i // 100}/w{i % 100}"


def chunk_values(seed: int, p: int, k: int, n: int) -> np.ndarray:
  """Process p's chunk of every leaf: (k, n) random float32."""
  return np.random.default_rng([seed, p]).standard_normal((k, n), np.float32)


def _array_spec(step: dict, p: int, i: int, P: int, n: int) -> dict:
  from ckpt.store import ocdbt  # pylint: disable=g-import-not-at-top
  from ckpt.format import tsspec  # pylint: disable=g-import-not-at-top
  return tsspec.array_spec("ocdbt", ocdbt.process_database(step, p),
                           leaf_path(i), (P * n,), np.dtype("float32"), (n,),
                           tsspec.Codec(None))


async def _write_zarr(step: dict, context, P: int, K: int, n: int,
                      seed: int) -> None:
  """Through the zarr3 driver, as save.write_owned writes."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  async def one(p: int):
    values = chunk_values(seed, p, K, n)
    if p == 0:
      meta = ts.Transaction()
      arrays = await asyncio.gather(*(ts.open(
          _array_spec(step, p, i, P, n), create=True, context=context,
          transaction=meta) for i in range(K)))
      await meta.commit_async()
      arrays = [a.with_transaction(None) for a in arrays]
    else:
      arrays = await asyncio.gather(*(ts.open(
          _array_spec(step, p, i, P, n), open=True, assume_metadata=True,
          context=context) for i in range(K)))
    txn = ts.Transaction()
    await asyncio.gather(*(a.with_transaction(txn)[p * n:(p + 1) * n].write(
        values[i]) for i, a in enumerate(arrays)))
    await txn.commit_async()

  for p in range(P):  # one process after another: bounded memory
    await one(p)


async def _reference(P: int, n: int) -> tuple[bytes, bytes, np.ndarray]:
  """(zarr.json, chunk 1's stored bytes, its values) as the zarr3 driver
  writes them into an OCDBT database (in memory)."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  from ckpt.store import ocdbt  # pylint: disable=g-import-not-at-top
  from ckpt.format import tsspec  # pylint: disable=g-import-not-at-top
  from ckpt.store import storage as storage_lib  # pylint: disable=g-import-not-at-top
  ctx = ts.Context({storage_lib.OCDBT_CACHE_POOL: {}})  # a fresh memory store
  db = ocdbt.database({"driver": "memory", "path": "ref/"})
  spec = tsspec.array_spec("ocdbt", db, "a", (P * n,), np.dtype("float32"),
                           (n,), tsspec.Codec(None))
  arr = await ts.open(spec, create=True, context=ctx)
  values = np.random.default_rng(1).standard_normal(n, np.float32)
  await arr[n:2 * n].write(values)
  kv = await ts.KvStore.open(db, context=ctx)
  meta = (await kv.read("a/zarr.json")).value
  chunk = (await kv.read("a/c/1")).value
  return meta, chunk, values


def _encoder(chunk: bytes, values: np.ndarray):
  """A function values -> stored bytes that reproduces the zarr3 driver's
  ``chunk`` (raw little-endian bytes, then a crc32c if its codecs add one)."""
  import crc32c  # pylint: disable=g-import-not-at-top
  raw = values.astype("<f4").tobytes()
  plain = lambda v: v.astype("<f4").tobytes()
  with_crc = lambda v: (lambda b: b + crc32c.crc32c(b).to_bytes(4, "little"))(
      v.astype("<f4").tobytes())
  for enc in (plain, with_crc):
    if enc(values) == chunk:
      return enc
  raise RuntimeError(
      f"writer 'kv' cannot reproduce the zarr3 driver's chunk bytes "
      f"({len(chunk)} bytes for {len(raw)} raw); use writer 'zarr'")


async def _write_kv(step: dict, context, P: int, K: int, n: int,
                    seed: int) -> None:
  """The same keys and bytes, straight into each OCDBT kvstore."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  from ckpt.store import ocdbt  # pylint: disable=g-import-not-at-top
  meta, chunk, ref_values = await _reference(P, n)
  encode = _encoder(chunk, ref_values)

  async def one(p: int):
    kv = await ts.KvStore.open(ocdbt.process_database(step, p),
                               context=context)
    values = chunk_values(seed, p, K, n)
    if p == 0:
      txn = ts.Transaction()
      t = kv.with_transaction(txn)
      for i in range(K):
        t[f"{leaf_path(i)}/zarr.json"] = meta
      await txn.commit_async()
    txn = ts.Transaction()
    t = kv.with_transaction(txn)
    for i in range(K):
      t[f"{leaf_path(i)}/c/{p}"] = encode(values[i])
    await txn.commit_async()

  sem = asyncio.Semaphore(8)

  async def bounded(p):
    async with sem:
      await one(p)
  await asyncio.gather(*(bounded(p) for p in range(P)))


def generate(path: str, P: int, K: int, conf: dict) -> float:
  from ckpt.store import storage as storage_lib  # pylint: disable=g-import-not-at-top
  storage = storage_lib.Storage(path)
  step = storage.step_spec("step")
  write = _write_kv if conf["writer"] == "kv" else _write_zarr
  t = time.perf_counter()
  asyncio.run(write(step, storage.context(), P, K, conf["chunk_floats"],
                    conf["seed"]))
  return time.perf_counter() - t


# ---- measuring one merge ------------------------------------------------------

def _step(path: str) -> tuple[dict, Any]:
  from ckpt.store import storage as storage_lib  # pylint: disable=g-import-not-at-top
  storage = storage_lib.Storage(path)
  return storage.step_spec("step"), storage.context()


def _proc_io() -> dict[str, int]:
  with open("/proc/self/io") as f:
    return {k: int(v) for k, v in (line.split(":") for line in f)}


def merge_once(path: str, P: int) -> dict[str, float]:
  """``ocdbt.merge`` as finalize runs it: seconds, /proc/self/io, and the
  peak of RSS above what it was before (the transaction's memory)."""
  from ckpt.store import ocdbt  # pylint: disable=g-import-not-at-top
  step, context = _step(path)
  io0 = _proc_io()
  with measure.measure(interval_s=0) as m:
    asyncio.run(ocdbt.merge(step, P, context))
  seconds, io1 = m.wall_s, _proc_io()
  return {"merge_s": seconds, "read_bytes": io1["rchar"] - io0["rchar"],
          "written_bytes": io1["wchar"] - io0["wchar"],
          "read_calls": io1["syscr"] - io0["syscr"],
          "write_calls": io1["syscw"] - io0["syscw"],
          "peak_rss_bytes": max(0, m.extra_rss)}


def merge_phased(path: str, P: int) -> dict[str, float]:
  """The stages of ``ocdbt.merge`` (the same calls), timed one by one."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  from ckpt.store import ocdbt  # pylint: disable=g-import-not-at-top
  step, context = _step(path)

  async def go():
    t0 = time.perf_counter()
    parent, *children = await asyncio.gather(
        ts.KvStore.open(ocdbt.database(step), context=context),
        *(ts.KvStore.open(ocdbt.process_database(step, p), context=context)
          for p in range(P)))
    t1 = time.perf_counter()
    txn = ts.Transaction(atomic=True)
    target = parent.with_transaction(txn)
    await asyncio.gather(*(c.experimental_copy_range_to(target)
                           for c in children))
    t2 = time.perf_counter()
    await txn.commit_async()
    t3 = time.perf_counter()
    return {"open_s": t1 - t0, "copy_s": t2 - t1, "commit_s": t3 - t2}
  return asyncio.run(go())


def merged_files(step_dir: str) -> tuple[int, int]:
  """(files, bytes) the merge added: everything outside ocdbt.process_*."""
  from ckpt.store import ocdbt  # pylint: disable=g-import-not-at-top
  files = size = 0
  for root, dirs, names in os.walk(step_dir):
    if root == step_dir:
      dirs[:] = [d for d in dirs if not d.startswith(ocdbt.PROCESS_DIR_PREFIX)]
    for name in names:
      files += 1
      size += os.path.getsize(os.path.join(root, name))
  return files, size


def verify(path: str, P: int, K: int, conf: dict) -> int:
  """Reads a sample of leaves from the merged database through the zarr3
  driver and compares them; returns the number of merged keys."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  from ckpt.store import ocdbt  # pylint: disable=g-import-not-at-top
  from ckpt.format import tsspec  # pylint: disable=g-import-not-at-top
  step, context = _step(path)
  n = conf["chunk_floats"]
  db = ocdbt.database(step)
  sample = sorted({int(i) for i in np.linspace(0, K - 1,
                                               min(K, conf["verify_leaves"]))})
  truth = {p: chunk_values(conf["seed"], p, K, n) for p in range(P)}

  async def go():
    for i in sample:
      spec = tsspec.array_spec("ocdbt", db, leaf_path(i), (P * n,),
                               np.dtype("float32"), (n,), tsspec.Codec(None))
      arr = await ts.open(spec, open=True, context=context)
      got = await arr.read()
      want = np.concatenate([truth[p][i] for p in range(P)])
      if not np.array_equal(got, want):
        raise AssertionError(f"merged leaf {leaf_path(i)} differs")
    kv = await ts.KvStore.open(db, context=context)
    return len(await kv.list())
  return asyncio.run(go())


_STRACE = re.compile(
    r"^\d+\s+(openat|read|pread64|write|pwrite64)\((?:AT_FDCWD(?:<[^>]*>)?, "
    r"\"([^\"]+)\"([^)]*)|(\d+)<([^>]+)>)")


def strace_files(path: str, P: int) -> tuple[int, int] | None:
  """(files read, files written) by one merge, from ``strace -f -y``."""
  if not shutil.which("strace"):
    return None
  with tempfile.TemporaryDirectory() as tmp:
    log = os.path.join(tmp, "strace.txt")
    proc = subprocess.run(
        ["strace", "-f", "-y", "-qq", "-e",
         "trace=openat,read,pread64,write,pwrite64", "-o", log,
         sys.executable, "-m", "scripts.scale_merge", "--merge-only", path,
         str(P)], capture_output=True, text=True, timeout=600,
        cwd=str(ROOT))
    if proc.returncode != 0:
      print(f"  merge: strace failed ({proc.stderr[-300:]}); no file counts",
            file=sys.stderr)
      return None
    read, written = set(), set()
    with open(log) as f:
      for line in f:
        m = _STRACE.match(line)
        if not m:
          continue
        call, opened, flags, _, fd_path = m.groups()
        name = opened or fd_path
        if not name or not name.startswith(os.path.join(path, "step")):
          continue
        if call == "openat":
          (written if re.search(r"O_WRONLY|O_RDWR|O_CREAT", flags or "")
           else read).add(name)
        elif call in ("read", "pread64"):
          read.add(name)
        else:
          written.add(name)
    # TensorStore writes "<name>.__lock" and renames it to "<name>".
    written = {w.removesuffix(".__lock") for w in written}
    read = {r for r in read if os.path.isfile(r)}
  return len(read), len(written)


def _link_copy(src: str, dst: str) -> None:
  shutil.copytree(src, dst, copy_function=os.link)


def measure_one(P: int, K: int, conf: dict, base: str) -> dict[str, Any]:
  gen = os.path.join(base, f"P{P}_K{K}")
  gen_s = generate(gen, P, K, conf)
  runs, phased = [], []
  for r in range(conf["repeats"]):
    a = f"{gen}.m{r}"
    _link_copy(gen, a)
    runs.append(merge_once(a, P))
    if r == 0:
      files, size = merged_files(os.path.join(a, "step"))
      keys = verify(a, P, K, conf)
      if keys != P * K + K:
        raise AssertionError(f"the merged database has {keys} keys, "
                             f"expected {P * K + K}")
    shutil.rmtree(a)
    b = f"{gen}.p{r}"
    _link_copy(gen, b)
    phased.append(merge_phased(b, P))
    shutil.rmtree(b)
  counts = None
  if conf["strace"]:
    c = f"{gen}.s"
    _link_copy(gen, c)
    counts = strace_files(c, P)
    shutil.rmtree(c)
  shutil.rmtree(gen)
  med = lambda xs, k: statistics.median(x[k] for x in xs)
  merged_keys = P * K + K
  row = {
      "processes": P, "keys": K, "merged_keys": merged_keys,
      "merge_s": med(runs, "merge_s"),
      "open_s": med(phased, "open_s"), "copy_s": med(phased, "copy_s"),
      "commit_s": med(phased, "commit_s"),
      "read_mb": med(runs, "read_bytes") / 1e6,
      "written_mb": med(runs, "written_bytes") / 1e6,
      "peak_mb": med(runs, "peak_rss_bytes") / 1e6,
      "read_calls": int(med(runs, "read_calls")),
      "write_calls": int(med(runs, "write_calls")),
      "files_read": counts[0] if counts else "n/a",
      "files_written": counts[1] if counts else "n/a",
      "merged_mb": size / 1e6, "merged_files": files,
      "bytes_per_key": size / merged_keys,
      "generate_s": gen_s,
  }
  row["us_per_key"] = 1e6 * row["merge_s"] / merged_keys
  return row


def run(conf: dict[str, Any]) -> list[dict[str, Any]]:
  conf = {**DEFAULTS, **conf}
  own = conf["dir"] is None
  base = tempfile.mkdtemp(prefix="ckpt-scale-merge-") if own else conf["dir"]
  rows = []
  try:
    for P in conf["processes"]:
      for K in conf["keys"]:
        if P * K > conf["max_chunks"]:
          print(f"  merge: P={P} K={K} skipped (P*K > max_chunks "
                f"{conf['max_chunks']})", file=sys.stderr)
          continue
        t = time.perf_counter()
        rows.append(measure_one(P, K, conf, base))
        print(f"  merge: P={P} K={K}: {rows[-1]['merge_s']:.3f} s "
              f"({time.perf_counter() - t:.0f} s with generation)",
              file=sys.stderr, flush=True)
  finally:
    if own:
      shutil.rmtree(base, ignore_errors=True)
  if conf["fit"] and len(rows) >= 3:
    rows.append(extrapolate(rows, *conf["extrapolate"]))
  return rows


# ---- the extrapolation --------------------------------------------------------

FITTED = ("merge_s", "open_s", "copy_s", "commit_s", "read_mb", "written_mb",
          "merged_mb", "peak_mb")


def fit(rows: list[dict], key: str) -> np.ndarray:
  """(a, b, c) of ``key = a + b*P + c*P*K`` (least squares)."""
  x = np.array([[1.0, r["processes"], r["processes"] * r["keys"]]
                for r in rows])
  y = np.array([float(r[key]) for r in rows])
  coef, *_ = np.linalg.lstsq(x, y, rcond=None)
  return coef


def extrapolate(rows: list[dict], P: int, K: int) -> dict[str, Any]:
  out: dict[str, Any] = {"processes": P, "keys": K, "merged_keys": P * K + K,
                         "extrapolated": True}
  for key in FITTED:
    a, b, c = fit(rows, key)
    out[key] = max(0.0, a + b * P + c * P * K)
    out[f"{key}_fit"] = [a, b, c]
  out.update(read_calls=0, write_calls=0, files_read="-", files_written="-",
             merged_files=0, generate_s=0.0)
  out["bytes_per_key"] = out["merged_mb"] * 1e6 / out["merged_keys"]
  out["us_per_key"] = 1e6 * out["merge_s"] / out["merged_keys"]
  return out


def table(rows: list[dict]) -> str:
  if not rows:
    return "(no rows)"
  head = "| " + " | ".join(c for c, _, _ in COLUMNS) + " |"
  rule = "|" + "|".join("---:" for _ in COLUMNS) + "|"
  body = []
  for r in rows:
    cells = [f.format(r[k]) for _, k, f in COLUMNS]
    if r.get("extrapolated"):
      cells = [f"*{c}*" if k in ("processes", "keys", "merged_keys") or
               k in FITTED or k in ("us_per_key", "bytes_per_key") else "-"
               for c, (_, k, _) in zip(cells, COLUMNS)]
    body.append("| " + " | ".join(cells) + " |")
  text = [head, rule, *body]
  fitted = [r for r in rows if r.get("extrapolated")]
  if fitted:
    r = fitted[0]
    a, b, c = r["merge_s_fit"]
    text += ["", (
        f"*italics*: extrapolated to {r['processes']:,} processes x "
        f"{r['keys']:,} leaves by a least-squares fit of t = a + b*P + "
        f"c*P*K over the measured rows: a = {a:.3g} s, b = {b * 1e3:.3g} "
        f"ms per process, c = {c * 1e6:.3g} µs per merged chunk key; "
        f"merged B+tree {r['merged_mb']:,.0f} MB, read {r['read_mb']:,.0f} "
        f"MB, written {r['written_mb']:,.0f} MB, all on process 0, before "
        "the commit.")]
  return "\n".join(text)


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "--merge-only":
    print(json.dumps(merge_once(sys.argv[2], int(sys.argv[3]))))
    sys.exit(0)
  from scripts import scale  # pylint: disable=g-import-not-at-top
  sys.exit(scale.main(["--part", "merge", *sys.argv[1:]]))
