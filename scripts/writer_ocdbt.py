"""Issue 50: format="ocdbt" saved by writer="thread" and writer="process".

usage: .venv/bin/python -m scripts.writer_ocdbt [--mib 256] [--rounds 3] [--dir DIR]

A save (``save()`` then ``wait_until_finished()``) of ``--mib`` MiB of
float32 (the dense state of /work/shared/limits/limits.py, 1024x4096
leaves sharded 4 ways over 8 CPU devices) with format "ocdbt", by each
writer, and the limit's save of the same bytes (``limits.dense_save``), in
the same process and round, who goes first rotating between rounds. One
Checkpointer per writer, its first save untimed (a process's first save
costs more whoever makes it). Per save:

- wall: seconds from ``save()`` to committed;
- CPU: seconds of CPU of this process (every thread) plus, with the writer
  process, of the writer (psutil), over the save;
- files: the files of the committed step, and of them the OCDBT data
  files (``ocdbt.process_0/d/``), with their bytes.

Prints medians over the rounds with min..max, the ratios to the limit, and
the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from scripts.writer_figures import load_limits, spread  # noqa: E402


def cpu_self() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def cpu_writers() -> float:
  import psutil  # pylint: disable=import-outside-toplevel
  total = 0.0
  for p in psutil.Process().children():
    try:
      if "ckpt.save.writer_main" in " ".join(p.cmdline()):
        t = p.cpu_times()
        total += t.user + t.system
    except psutil.Error:
      pass
  return total


def files_of(step_dir: str) -> tuple[int, int, int]:
  """(files, OCDBT data files, their bytes) of a committed step."""
  n, data, nbytes = 0, 0, 0
  for d, _, names in os.walk(step_dir):
    n += len(names)
    if os.path.basename(d) == "d" and "ocdbt.process_" in d:
      data += len(names)
      nbytes += sum(os.path.getsize(os.path.join(d, x)) for x in names)
  return n, data, nbytes


def one(ckptr, state, root: str, step: int) -> dict:
  c0, w0, t0 = cpu_self(), cpu_writers(), time.perf_counter()
  ckptr.save(step, state)
  ckptr.wait_until_finished()
  wall = time.perf_counter() - t0
  cpu = cpu_self() - c0 + cpu_writers() - w0
  n, data, nbytes = files_of(os.path.join(root, f"checkpoint_{step}"))
  return {"wall": wall, "cpu": cpu, "files": n, "data_files": data,
          "data_mib": nbytes / 2**20}


def main() -> None:
  import ckpt  # pylint: disable=import-outside-toplevel
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=int, default=256)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--dir", default=None)
  args = ap.parse_args()
  load0 = open("/proc/loadavg").read().split()[:3]
  limits = load_limits()
  base = args.dir or tempfile.mkdtemp(prefix="ckpt-writer-ocdbt-")
  state = limits.dense_state(limits.mesh(), args.mib)
  ckptrs = {w: ckpt.Checkpointer(os.path.join(base, w), writer=w,
                                 format="ocdbt", keep=1)
            for w in ("thread", "process")}
  for c in ckptrs.values():  # the first save of each: untimed
    c.save(0, state)
    c.wait_until_finished()
  rows: dict[str, list[dict]] = {"thread": [], "process": [], "limit": []}
  order = ["thread", "process", "limit"]
  for r in range(args.rounds):
    for who in order[r % 3:] + order[:r % 3]:
      if who == "limit":
        path = os.path.join(base, "limit")
        shutil.rmtree(path, ignore_errors=True)
        c0, t0 = cpu_self(), time.perf_counter()
        limits.dense_save(path, state)
        rows["limit"].append({"wall": time.perf_counter() - t0,
                              "cpu": cpu_self() - c0})
      else:
        rows[who].append(one(ckptrs[who], state, os.path.join(base, who),
                             r + 1))
  for c in ckptrs.values():
    c.close()
  lim_wall = statistics.median(x["wall"] for x in rows["limit"])
  lim_cpu = statistics.median(x["cpu"] for x in rows["limit"])
  print(f"format ocdbt, {args.mib} MiB, 8 CPU devices, {args.rounds} rounds; "
        f"load {load0} -> {open('/proc/loadavg').read().split()[:3]}")
  print("who      wall s              CPU s               x limit "
        "(wall, CPU)  files  data files (MiB)")
  for who in ("thread", "process", "limit"):
    rs = rows[who]
    wall = [x["wall"] for x in rs]
    cpu = [x["cpu"] for x in rs]
    line = (f"{who:8} {spread(wall):19} {spread(cpu):19} "
            f"{statistics.median(wall) / lim_wall:5.2f} "
            f"{statistics.median(cpu) / lim_cpu:5.2f}")
    if who != "limit":
      line += (f"         {statistics.median(x['files'] for x in rs):5.0f}  "
               f"{statistics.median(x['data_files'] for x in rs):4.0f} "
               f"({statistics.median(x['data_mib'] for x in rs):.1f})")
    print(line)
  if not args.dir:
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
  main()
