"""Benchmark: what ``reuse_unchanged=True`` saves, and what it costs.

Usage (from the repository root):
  python -m scripts.reuse_cost [--frozen-mib 256] [--train-mib 5]
      [--dense-mib 256] [--rounds 5] [--format zarr] [--dir D] [--json F]

Random float32 leaves (never constant) on a mesh of 8 CPU devices, sync
saves (``async_save=False``), each into its own root:

- ``frozen+train, reuse``: a frozen base (``--frozen-mib``, same bytes at
  every step) and a trainable part (``--train-mib``, new bytes at every
  step), saved with ``reuse_unchanged=True``;
- ``frozen+train, no reuse``: the same saves with reuse off;
- ``train alone``: the trainable part only (the yardstick of the targets);
- ``dense, reuse`` / ``dense, no reuse``: a state of ``--dense-mib`` whose
  every byte changes at every step (dense training: the cost of hashing).

``--s3-emulator`` (or ``--url s3://bucket/prefix``): the frozen+train pair
and the trainable part alone on a bucket (the suite's moto S3 emulator on
loopback, started and stopped here), where the bytes handed to the store
are counted from the server: the sizes of the objects of each new step's
data directory, read back after the save.

Every save after the first two (which write two copies) is measured (scripts/benchlib/measure.py): CPU
seconds of this process (the figure to compare on a shared machine), wall
seconds, and the bytes handed to the kernel by write calls (``wchar`` of
/proc/self/io: the bytes to the disk). The dense pair alternates its order
every round. Prints medians (and the least CPU seconds: the figure least
disturbed by other work on a shared machine) and the targets, as ratios: reuse saves
hand at most 1.5x the changing bytes + 8 MiB to the disk (issue 39) and
take at most 1.2x the wall and the CPU of saving the changing part alone
(issue 47, item 5); the dense overhead (everything changes) is at most 2%
of CPU (issue 47: what reuse on by default may cost).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402

from scripts.benchlib import measure  # noqa: E402

MIB = 1 << 20


def wchar() -> int:
  """Bytes this process has passed to write calls so far (every thread)."""
  with open("/proc/self/io") as f:
    for line in f:
      if line.startswith("wchar:"):
        return int(line.split()[1])
  return 0


def _leaf(mib: float, seed) -> np.ndarray:
  rows = max(8, int(mib * MIB) // (4 * 1024) // 8 * 8)
  return np.random.default_rng(seed).standard_normal((rows, 1024),
                                                     dtype=np.float32)


def stored_bytes(url: str, step: int) -> int:
  """The bytes of the objects in ``step``'s data directory of a bucket."""
  from ckpt.commit import steps as steps_lib  # pylint: disable=g-import-not-at-top
  from ckpt.store import storage as storage_lib  # pylint: disable=g-import-not-at-top
  st = storage_lib.Storage(url)
  where = steps_lib.step_dir(st, step)
  return sum(len(st.read_bytes(k)) for k in st.list_keys(f"{where}/"))


class Run:
  """Saves into one root; ``save`` measures one save."""

  def __init__(self, name: str, base: str, fmt: str, reuse: bool):
    import ckpt  # pylint: disable=g-import-not-at-top
    self.name = name
    self.root = (base.rstrip("/") + "/" if "://" in base else base + os.sep
                 ) + name.replace(" ", "_").replace(",", "").replace("+", "_")
    self.ckptr = ckpt.Checkpointer(self.root, format=fmt, keep=2,
                                   async_save=False, reuse_unchanged=reuse)
    self.step = 0
    self.rows: list[dict] = []

  def save(self, state: dict, record: bool = True) -> None:
    w0 = wchar()
    with measure.measure(interval_s=0) as m:
      self.ckptr.save(self.step, state)
    s = self.ckptr.last_save_stats
    if record:
      sent = wchar() - w0
      if "://" in self.root:  # the objects the store now holds for it
        sent = stored_bytes(self.root, self.step)
      self.rows.append({"cpu_s": m.cpu_s, "wall_s": m.wall_s,
                        "wchar": sent, "written": s.bytes_written,
                        "reused": s.bytes_reused})
    self.step += 1

  def median(self, key: str) -> float:
    return statistics.median(r[key] for r in self.rows)

  def close(self) -> None:
    self.ckptr.close()


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--frozen-mib", type=float, default=256)
  ap.add_argument("--train-mib", type=float, default=5)
  ap.add_argument("--dense-mib", type=float, default=256)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--format", default="zarr")
  ap.add_argument("--dir", default=None)
  ap.add_argument("--json", default=None, help="write the figures here")
  ap.add_argument("--dense-only", action="store_true",
                  help="only the dense pair (the overhead, with more rounds)")
  ap.add_argument("--url", default=None,
                  help="a bucket root (s3://b/p, gs://b/p): the frozen+train "
                  "pair and the trainable part alone, saved there")
  ap.add_argument("--s3-emulator", action="store_true",
                  help="--url on the test suite's moto S3 emulator")
  ap.add_argument("--chunk-work", action="store_true",
                  help="only the per-chunk work a dense save does with and "
                  "without reuse, timed alone (CPU seconds)")
  a = ap.parse_args(argv)
  if a.chunk_work:
    return _chunk_work(a.dense_mib, max(a.rounds, 1))
  if a.s3_emulator:
    return _on_emulator(a, argv)
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))

  def put(x):
    return jax.device_put(x, sh)

  frozen = put(_leaf(a.frozen_mib, 0))
  trains = [put(_leaf(a.train_mib, [1, i])) for i in range(a.rounds + 2)]
  denses = [put(_leaf(0 if a.url else a.dense_mib, [2, i]))
            for i in range(a.rounds + 2)]
  base = a.url or tempfile.mkdtemp(dir=a.dir, prefix="reuse-cost-")
  names = [("dense, reuse", True), ("dense, no reuse", False)]
  if a.url:  # a bucket: the bytes to the store, not the dense pair
    names = [("frozen+train, reuse", True), ("train alone", False)]
  elif not a.dense_only:
    names += [("frozen+train, reuse", True), ("frozen+train, no reuse", False),
              ("train alone", False)]
  runs = {n: Run(n, base, a.format, reuse) for n, reuse in names}
  try:
    for i in range(a.rounds + 2):
      record = i > 1  # the first two write everything (two copies)
      if not a.dense_only:
        for n in ("frozen+train, reuse", "frozen+train, no reuse"):
          if n in runs:
            runs[n].save({"frozen": frozen, "train": trains[i]}, record)
        runs["train alone"].save({"train": trains[i]}, record)
      if a.url:
        continue
      dense = ["dense, reuse", "dense, no reuse"]
      for n in (dense if i % 2 == 0 else dense[::-1]):
        runs[n].save({"dense": denses[i]}, record)
    figures = {n: {**{k: r.median(k) for k in r.rows[0]},
                   "cpu_min_s": min(x["cpu_s"] for x in r.rows)}
               for n, r in runs.items()}
  finally:
    for r in runs.values():
      r.close()
    if not a.url:
      shutil.rmtree(base, ignore_errors=True)
  train_bytes = trains[0].nbytes
  print(f"format {a.format}; frozen {frozen.nbytes / MIB:.1f} MiB, train "
        f"{train_bytes / MIB:.1f} MiB, dense {denses[0].nbytes / MIB:.1f} "
        f"MiB; medians of {a.rounds} saves after the first two")
  print(f"{'run':24} {'CPU s':>7} {'wall s':>7} "
        f"{'to store MiB' if a.url else 'to disk MiB':>12} "
        f"{'written MiB':>12} {'reused MiB':>11}")
  for n, f in figures.items():
    print(f"{n:24} {f['cpu_s']:7.3f} {f['wall_s']:7.3f} "
          f"{f['wchar'] / MIB:12.2f} {f['written'] / MIB:12.2f} "
          f"{f['reused'] / MIB:11.2f}")
  if not a.url:
    on, off = figures["dense, reuse"], figures["dense, no reuse"]
    for key in ("cpu_s", "cpu_min_s", "wall_s"):
      over = on[key] / max(off[key], 1e-9) - 1
      verdict = ("" if key == "wall_s" else
                 f" (limit +2%): {'met' if over <= 0.02 else 'MISSED'}")
      print(f"dense overhead of reuse, {key}: {100 * over:+.1f}% "
            f"({on[key] / max(off[key], 1e-9):.3f}x){verdict}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"args": vars(a), "figures": figures}, f, indent=1)
  if a.dense_only:
    return 0
  ft, alone = figures["frozen+train, reuse"], figures["train alone"]
  limit = 1.5 * train_bytes + 8 * MIB
  print(f"target: reuse hands {ft['wchar'] / MIB:.2f} MiB to the "
        f"{'store' if a.url else 'disk'} "
        f"(limit {limit / MIB:.2f}): "
        f"{'met' if ft['wchar'] <= limit else 'MISSED'}")
  for key in ("cpu_s", "cpu_min_s", "wall_s"):
    ratio = ft[key] / max(alone[key], 1e-9)
    print(f"target: reuse save / train alone, {key}: {ratio:.2f}x (limit "
          f"1.2x): {'met' if ratio <= 1.2 else 'MISSED'}")
  return 0


def _chunk_work(mib: float, rounds: int) -> int:
  """A dense save's per-chunk work on ``mib`` of float32 in 32 MiB chunks:
  crc32c per chunk (no reuse: write.chunk_sums), reuse's sort of chunks
  that changed at the previous save (SaveReuse.sort), an xxh3-128 hash."""
  import time  # pylint: disable=g-import-not-at-top
  from ckpt.format.crc import digest  # pylint: disable=g-import-not-at-top
  from ckpt.save import reuse, write  # pylint: disable=g-import-not-at-top
  from ckpt.shards import plan as plan_lib  # pylint: disable=g-import-not-at-top
  data = _leaf(mib, 3)
  box = plan_lib.Box((0, 0), data.shape)
  chunks = (max(8, (32 * MIB) // (4 * data.shape[1])), data.shape[1])
  prev = reuse.Generation(0, "0", {"x": 1}, {
      ("x", b.start, b.stop): reuse.Stored(None, 12345, b.size * 4)
      for b in plan_lib.chunk_boxes(box, chunks)})
  sr = reuse.SaveReuse.__new__(reuse.SaveReuse)  # its sort only
  sr.relpaths, sr.layouts, sr.held, sr.previous = ["x"], {"x": 1}, None, prev
  work = {"crc32c per chunk (no reuse)": lambda: write.chunk_sums(
              box, chunks, data),
          "reuse sort, changed chunks": lambda: sr.sort(0, box, chunks, data,
                                                        link=False),
          "xxh3-128 of all": lambda: digest(data)}
  got = {k: [] for k in work}
  for i in range(rounds):
    for k in (list(work) if i % 2 == 0 else list(work)[::-1]):
      t = time.process_time()
      work[k]()
      got[k].append(time.process_time() - t)
  for k, v in got.items():
    print(f"{k:30} median {statistics.median(v) * 1e3:7.1f} ms, least "
          f"{min(v) * 1e3:7.1f} ms ({data.nbytes / MIB:.0f} MiB, {rounds} runs)")
  return 0


def _on_emulator(a, argv) -> int:
  """Runs the bucket figures on a moto S3 server started here."""
  from tests.objectstore import servers  # pylint: disable=g-import-not-at-top
  logs = tempfile.mkdtemp(prefix="reuse-cost-moto-")
  server = servers.start_moto(logs)
  try:
    os.environ.update(server.env)
    url = servers.new_bucket(server) + "/reuse-cost"
    rest = [x for x in (argv if argv is not None else sys.argv[1:])
            if x != "--s3-emulator"]
    return main(rest + ["--url", url])
  finally:
    server.stop()
    shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
