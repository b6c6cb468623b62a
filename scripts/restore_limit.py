"""Benchmark: ckpt's verified restore as a ratio to the limit (issue 47, item 1).

Usage (from the repository root):
  python -m scripts.restore_limit [--rounds 3] [--cold-rounds 3] [--dir D]

The limit is ../shared/limits/limits.py (loaded by path, never copied): its
dense state (64 leaves of (1024, 4096) float32 = 1 GiB on a (data=2,
model=4) mesh of 8 CPU devices), ``dense_save`` and ``dense_restore``. Each
round runs both in this one process, who goes first alternating:

- ckpt: ``Checkpointer(async_save=False).save(1, state)``, then, right
  after, ``restore(step=1, target=<same shardings>)`` (verified), then the
  same onto a (data=4, model=2) mesh, then ``--pairs`` pairs of one restore
  with ``verify=False`` and one with ``verify=True`` (the order alternating;
  their medians);
- the limit: ``dense_save``, then ``dense_restore``.

Printed per figure: the median over rounds of ckpt / limit in the same
round (and the spread), wall and CPU (process time, every thread):

- ``same``: the restore right after the save / the limit's restore (<= 1.25x);
- ``other``: onto the (4, 2) mesh / the limit's restore (<= 1.5x);
- ``verify``: verified minus ``verify=False`` CPU / one crc32c pass (the
  ``crc32c`` package) over the bytes restored, timed in the same round
  (<= 1.3x); and that extra wall / that extra CPU (<= 1x);
- ``cold`` (``--cold-rounds``): each system's checkpoint restored in a fresh
  child process, its files' pages evicted from the page cache first
  (fsync, then ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file: the
  machine's whole cache is not dropped, which would slow every other job on
  it), who goes first alternating / the limit's (<= 1.1x).

The first round's restores are checked bit for bit against the state,
outside the timing; each cold child checks its result's per-leaf sums.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMITS_FILE = ROOT / ".." / "shared" / "limits" / "limits.py"
TARGETS = {"same": 1.25, "other": 1.5, "verify_cpu": 1.3, "verify_wall": 1.0,
           "cold": 1.1}


def load_limits():
  spec = importlib.util.spec_from_file_location("limits", LIMITS_FILE)
  limits = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(limits)
  return limits


def timed(fn):
  """(fn()'s value, ready; wall s; CPU s of the whole process)."""
  import jax  # pylint: disable=g-import-not-at-top
  c, t = time.process_time(), time.perf_counter()
  value = jax.block_until_ready(fn())
  return value, time.perf_counter() - t, time.process_time() - c


class Abstract:
  """What ``limits.dense_restore`` asks of a state's leaf (shape, dtype,
  sharding, addressable_shards' index) without its data: a cold child
  builds no 1 GiB state."""

  class Shard:
    def __init__(self, index):
      self.index = index

  def __init__(self, shape, dtype, sharding):
    self.shape, self.dtype, self.sharding = tuple(shape), dtype, sharding
    self.addressable_shards = [
        self.Shard(i) for i in
        sharding.addressable_devices_indices_map(self.shape).values()]


def abstract_state(limits, m):
  """The limit's dense state's shapes, as ``Abstract`` leaves and as
  ckpt targets (``jax.ShapeDtypeStruct``), on mesh ``m``."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  leaves, targets = {}, {}
  for i in range(64):
    spec = P("model", None) if i % 2 else P(None, "model")
    s = NamedSharding(m, spec)
    leaves[f"layer_{i:03d}"] = {"w": Abstract((1024, 4096), np.dtype("float32"), s)}
    targets[f"layer_{i:03d}"] = {"w": jax.ShapeDtypeStruct(
        (1024, 4096), np.float32, sharding=s)}
  return leaves, targets


def other_mesh(limits):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


def crc_pass(state) -> float:
  """CPU seconds of one crc32c pass over every distinct shard's bytes."""
  import crc32c  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  seen, bufs = set(), []
  for x in jax.tree.leaves(state):
    for s in x.addressable_shards:
      key = (id(x), str(s.index))
      if key not in seen:
        seen.add(key)
        bufs.append(np.asarray(s.data))
  t = time.process_time()
  for b in bufs:
    crc32c.crc32c(memoryview(b).cast("B"))
  return time.process_time() - t


def same(a, b) -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  return all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def evict(path: str) -> None:
  """Drops the page cache of every file under ``path`` (fsync first: dirty
  pages are not dropped)."""
  for root, _, files in os.walk(path):
    for name in files:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def ckpt_round(ckpt, path, state, targets, r, check, pairs) -> dict:
  c = ckpt.Checkpointer(path, async_save=False)
  try:
    c.save(1, state)
    out = {}
    got, out["same_s"], out["same_cpu"] = timed(
        lambda: c.restore(step=1, target=targets["same"]))
    if check:
      assert same(got, state), "ckpt's restore differs from the state"
    del got
    got, out["other_s"], out["other_cpu"] = timed(
        lambda: c.restore(step=1, target=targets["other"]))
    if check:
      assert same(got, state), "ckpt's restore onto (4, 2) differs"
    del got
    got = {k: [] for k in ("v0_s", "v0_cpu", "v1_s", "v1_cpu")}
    for p in range(pairs):
      for verify in ((False, True) if (r + p) % 2 == 0 else (True, False)):
        value, wall, cpu = timed(lambda: c.restore(
            step=1, target=targets["same"], verify=verify))
        del value
        got[f"v{int(verify)}_s"].append(wall)
        got[f"v{int(verify)}_cpu"].append(cpu)
    out.update({k: statistics.median(v) for k, v in got.items()})
  finally:
    c.close()
  return out


def limit_round(limits, path, state, check) -> dict:
  limits.dense_save(path, state)
  got, wall, cpu = timed(lambda: limits.dense_restore(path, state))
  if check:
    assert same(got, state), "the limit's restore differs from the state"
  return {"limit_s": wall, "limit_cpu": cpu}


def child(system: str, path: str, sums: list[float]) -> int:
  """One cold restore in this fresh process: its figures, one JSON line."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  limits = load_limits()
  leaves, targets = abstract_state(limits, limits.mesh())
  if system == "ckpt":
    import ckpt  # pylint: disable=g-import-not-at-top
    c = ckpt.Checkpointer(path)
    got, wall, cpu = timed(lambda: c.restore(step=1, target=targets))
    c.close()
  else:
    got, wall, cpu = timed(lambda: limits.dense_restore(path, leaves))
  found = [float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(got)]
  if not np.allclose(found, sums):
    raise SystemExit(f"{system}: the cold restore's leaf sums differ")
  print("FIGURES " + json.dumps({"s": wall, "cpu": cpu}), flush=True)
  return 0


def cold_rounds(limits, ckpt, where, state, rounds) -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  paths = {"ckpt": os.path.join(where, "cold-ckpt"),
           "limit": os.path.join(where, "cold-limit")}
  with ckpt.Checkpointer(paths["ckpt"], async_save=False) as c:
    c.save(1, state)
  limits.dense_save(paths["limit"], state)
  sums = [float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(state)]
  sums_file = os.path.join(where, "sums.json")
  with open(sums_file, "w") as f:
    json.dump(sums, f)
  out = []
  for r in range(rounds):
    got = {}
    for s in (("ckpt", "limit") if r % 2 == 0 else ("limit", "ckpt")):
      evict(paths[s])
      proc = subprocess.run(
          [sys.executable, "-m", "scripts.restore_limit", "--child", s,
           paths[s], sums_file], capture_output=True, text=True,
          timeout=1200, cwd=ROOT, check=False)
      lines = [l for l in proc.stdout.splitlines() if l.startswith("FIGURES ")]
      if proc.returncode or not lines:
        raise SystemExit(f"cold child {s} failed:\n{proc.stderr[-3000:]}")
      got[s] = json.loads(lines[0].split(" ", 1)[1])
    out.append(got)
    print(f"  cold round {r + 1}: ckpt {got['ckpt']['s']:.3f} s (CPU "
          f"{got['ckpt']['cpu']:.3f}), limit {got['limit']['s']:.3f} s (CPU "
          f"{got['limit']['cpu']:.3f}): {got['ckpt']['s'] / got['limit']['s']:.2f}x",
          flush=True)
  return out


def line(name: str, ratios: list[float], extra: str = "") -> str:
  med = statistics.median(ratios)
  target = TARGETS[name]
  return (f"{name:12s} {med:5.2f}x ({min(ratios):.2f}-{max(ratios):.2f}), "
          f"target <= {target}x: {'met' if med <= target else 'MISSED'}"
          f"{extra}")


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--cold-rounds", type=int, default=3)
  ap.add_argument("--pairs", type=int, default=3,
                  help="verify=False / verify=True restores per round "
                  "(their medians)")
  ap.add_argument("--dir", default=None, help="where the checkpoints go "
                  "(default: a temporary directory, removed at the end)")
  ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.child:
    with open(a.child[2]) as f:
      return child(a.child[0], a.child[1], json.load(f))
  import tempfile  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top
  limits = load_limits()
  m = limits.mesh()
  state = limits.dense_state(m)
  _, same_t = abstract_state(limits, m)
  _, other_t = abstract_state(limits, other_mesh(limits))
  targets = {"same": same_t, "other": other_t}
  where = tempfile.mkdtemp(dir=a.dir, prefix="restore-limit-")
  print(f"load {open('/proc/loadavg').read().split()[:3]}, {os.cpu_count()} "
        f"cores; {a.rounds} rounds, who goes first alternating", flush=True)
  rows = []
  try:
    for r in range(a.rounds):
      row = {}
      for who in (("ckpt", "limit") if r % 2 == 0 else ("limit", "ckpt")):
        path = os.path.join(where, f"{who}-{r}")
        if who == "ckpt":
          row.update(ckpt_round(ckpt, path, state, targets, r, r == 0,
                                a.pairs))
        else:
          row.update(limit_round(limits, path, state, r == 0))
        shutil.rmtree(path, ignore_errors=True)
      row["crc_cpu"] = crc_pass(state)
      rows.append(row)
      print(f"  round {r + 1}: limit {row['limit_s']:.3f} s (CPU "
            f"{row['limit_cpu']:.3f}); ckpt same {row['same_s']:.3f} s (CPU "
            f"{row['same_cpu']:.3f}), other {row['other_s']:.3f} s, "
            f"verify=False {row['v0_s']:.3f} s (CPU {row['v0_cpu']:.3f}), "
            f"verify=True {row['v1_s']:.3f} s (CPU {row['v1_cpu']:.3f}); "
            f"crc32c pass CPU {row['crc_cpu']:.3f} s", flush=True)
    cold = cold_rounds(limits, ckpt, where, state, a.cold_rounds) if (
        a.cold_rounds) else []
  finally:
    shutil.rmtree(where, ignore_errors=True)
  print(f"\nratios to the limit (medians over rounds, range), load "
        f"{open('/proc/loadavg').read().split()[:3]}:")
  cpu = lambda k: statistics.median(  # noqa: E731
      row[f"{k}_cpu"] / row["limit_cpu"] for row in rows)
  print(line("same", [w["same_s"] / w["limit_s"] for w in rows],
             f"; CPU {cpu('same'):.2f}x the limit's"))
  print(line("other", [w["other_s"] / w["limit_s"] for w in rows],
             f"; CPU {cpu('other'):.2f}x the limit's"))
  extra_cpu = [w["v1_cpu"] - w["v0_cpu"] for w in rows]
  extra_wall = [w["v1_s"] - w["v0_s"] for w in rows]
  print(line("verify_cpu", [e / w["crc_cpu"] for e, w in zip(extra_cpu, rows)],
             f" (extra CPU median {statistics.median(extra_cpu):.3f} s, one "
             f"crc32c pass {statistics.median(w['crc_cpu'] for w in rows):.3f} s)"))
  print(line("verify_wall", [max(w, 0) / max(c, 1e-3)
                             for w, c in zip(extra_wall, extra_cpu)],
             f" (extra wall median {statistics.median(extra_wall):.3f} s)"))
  if cold:
    print(line("cold", [c["ckpt"]["s"] / c["limit"]["s"] for c in cold],
               f"; CPU {statistics.median(c['ckpt']['cpu'] / c['limit']['cpu'] for c in cold):.2f}x"
               " the limit's (files evicted with POSIX_FADV_DONTNEED, not a "
               "dropped page cache)"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
