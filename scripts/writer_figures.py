"""Issue 50, item 4: writer="thread" vs writer="process", measured.

usage: .venv/bin/python -m scripts.writer_figures [--mib 256] [--rounds 3] [--dir DIR]

For each round, each writer (the order alternates between rounds) and each
training step (``gil``: 300 tiny eager ops, whose Python dispatch holds
the GIL; ``nogil``: one jitted 768x768 matmul chain, whose XLA compute does
not), on 8 CPU devices, with ``--mib`` MiB of float32 (the dense state of
/work/shared/limits/limits.py: 1024x4096 leaves sharded 4 ways):

- step slowdown: the median step time while an async save runs, over the
  median without a save (same process, just before);
- save() blocking time, and the save's length (save() to committed);
- host memory (in a save of its own, untimed): the peak, over the
  pre-save level, of the trainer's and the writer's anonymous memory plus
  the bytes in /dev/shm of this trainer (shared memory counted once, page
  cache not counted); and the limit's save time of the same bytes
  (limits.dense_save) in the same round;
- trainer death to commit (writer="process" only): a trainer process saves,
  is SIGKILLed as soon as save() returned, and the time until the step is
  committed is timed (with writer="thread" the step is never committed).

Prints medians over the rounds, with min..max, and the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_limits():
  spec = importlib.util.spec_from_file_location(
      "limits", ROOT / ".." / "shared" / "limits" / "limits.py")
  if not os.path.exists(spec.origin):  # the worktree layout: /work/shared
    spec = importlib.util.spec_from_file_location(
        "limits", "/work/shared/limits/limits.py")
  limits = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(limits)
  return limits


def anon_bytes(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/smaps_rollup") as f:
      for line in f:
        if line.startswith("Anonymous:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def writer_pids() -> list[int]:
  import psutil  # pylint: disable=import-outside-toplevel
  return [p.pid for p in psutil.Process().children()
          if "ckpt.save.writer_main" in " ".join(p.cmdline())]


def host_bytes(writers: list[int]) -> int:
  """Anonymous memory of this trainer and its ``writers``, plus its
  segments."""
  me = os.getpid()
  shm = 0
  for n in os.listdir("/dev/shm"):
    if n.startswith(f"ckpt-{me}-"):
      try:
        shm += os.stat(os.path.join("/dev/shm", n)).st_size
      except OSError:
        pass
  return anon_bytes(me) + sum(anon_bytes(p) for p in writers) + shm


class Sampler:
  """The peak of ``host_bytes()`` every 50 ms while running."""

  def __init__(self):
    self.writers = writer_pids()
    self.peak, self._stop = 0, threading.Event()
    self._t = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, host_bytes(self.writers))
      self._stop.wait(0.05)

  def __enter__(self):
    self._t.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._t.join()


def steps():
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  small = jnp.ones((4,), jnp.float32)
  w = jnp.ones((768, 768), jnp.float32) / 768

  def gil():
    x = small
    for _ in range(300):
      x = x + 1.0
    x.block_until_ready()

  mm = jax.jit(lambda a: ((a @ w) @ w) @ w)

  def nogil():
    mm(w).block_until_ready()
  gil(), nogil()
  return {"gil": gil, "nogil": nogil}


def one(writer: str, step_fn, state, root: str, step: int) -> dict:
  import ckpt  # pylint: disable=import-outside-toplevel
  shutil.rmtree(root, ignore_errors=True)
  ckptr = ckpt.Checkpointer(root, writer=writer, keep=1,
                            concurrent_bytes=2 << 30)
  try:
    ckptr.save(step - 1, state)  # the writer started, the plan cached
    ckptr.wait_until_finished()
    base = []
    for _ in range(30):
      t = time.perf_counter()
      step_fn()
      base.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    ckptr.save(step, state)
    blocking = time.perf_counter() - t0
    during = []
    while ckptr.is_saving_in_progress():
      t = time.perf_counter()
      step_fn()
      during.append(time.perf_counter() - t)
    ckptr.wait_until_finished()
    length = time.perf_counter() - t0
    # Memory in a save of its own: sampling /proc/<pid>/smaps_rollup takes
    # the trainer's mmap lock, which would slow the timed save above.
    level = host_bytes(writer_pids())
    with Sampler() as mem:
      ckptr.save(step + 1, state)
      ckptr.wait_until_finished()
    return {"slowdown": statistics.median(during or [0]) /
                        statistics.median(base),
            "steps": len(during), "blocking_s": blocking, "save_s": length,
            "host_mib": (mem.peak - level) / (1 << 20)}
  finally:
    ckptr.close()


def death_to_commit(mib: int, root: str) -> float:
  """A trainer process SIGKILLed as soon as save() returned: seconds from
  the kill until the step is committed (its writer finishing it)."""
  shutil.rmtree(root, ignore_errors=True)
  proc = subprocess.Popen([sys.executable, "-m", "scripts.writer_figures",
                           "--trainer", root, "--mib", str(mib)],
                          cwd=ROOT, stdout=subprocess.PIPE, text=True)
  line = proc.stdout.readline()
  proc.send_signal(signal.SIGKILL)
  t0 = time.monotonic()
  proc.wait()
  if not line:
    raise RuntimeError("the trainer ended before save() returned")
  done = os.path.join(root, "checkpoint_1")
  while not os.path.exists(done):
    if time.monotonic() - t0 > 600:
      raise RuntimeError("no commit within 600 s of the trainer's death")
    time.sleep(0.005)
  return time.monotonic() - t0


def trainer(root: str, mib: int) -> None:
  limits = load_limits()
  import ckpt  # pylint: disable=import-outside-toplevel
  state = limits.dense_state(limits.mesh(), mib)
  ckptr = ckpt.Checkpointer(root, writer="process", concurrent_bytes=2 << 30)
  ckptr.save(1, state)
  print("returned", flush=True)
  time.sleep(600)


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
  return (f"{fmt.format(statistics.median(xs))} "
          f"({fmt.format(min(xs))}..{fmt.format(max(xs))})")


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=int, default=256)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--dir", default=None)
  ap.add_argument("--trainer", default=None)
  args = ap.parse_args()
  if args.trainer:
    trainer(args.trainer, args.mib)
    return
  limits = load_limits()
  base = args.dir or tempfile.mkdtemp(prefix="ckpt-writer-figures-")
  state = limits.dense_state(limits.mesh(), args.mib)
  fns = steps()
  rows: dict[tuple[str, str], list[dict]] = {}
  limit_s, deaths = [], []
  for r in range(args.rounds):
    order = ["thread", "process"] if r % 2 == 0 else ["process", "thread"]
    for writer in order:
      for kind, fn in fns.items():
        rows.setdefault((writer, kind), []).append(
            one(writer, fn, state, os.path.join(base, "c"), 4 * r + 4))
    t = time.perf_counter()
    shutil.rmtree(os.path.join(base, "limit"), ignore_errors=True)
    limits.dense_save(os.path.join(base, "limit"), state)
    limit_s.append(time.perf_counter() - t)
    deaths.append(death_to_commit(args.mib, os.path.join(base, "d")))
  print(f"state {args.mib} MiB, 8 CPU devices, {args.rounds} rounds; "
        f"load {open('/proc/loadavg').read().split()[:3]}")
  print("writer   step   slowdown (x)      steps  save() blocks s    "
        "save s            host MiB")
  for (writer, kind), rs in sorted(rows.items()):
    print(f"{writer:8} {kind:6} {spread([x['slowdown'] for x in rs]):17} "
          f"{statistics.median([x['steps'] for x in rs]):5.0f}  "
          f"{spread([x['blocking_s'] for x in rs], '{:.3f}'):17} "
          f"{spread([x['save_s'] for x in rs]):17} "
          f"{spread([x['host_mib'] for x in rs], '{:.0f}')}")
  print(f"limit (limits.dense_save of the same bytes): {spread(limit_s)} s")
  print(f"trainer SIGKILLed after save() returned -> committed (process): "
        f"{spread(deaths)} s; writer='thread': never (the save dies with it)")
  print(json.dumps({"rows": {f"{w}/{k}": v for (w, k), v in rows.items()},
                    "limit_s": limit_s, "death_to_commit_s": deaths}))
  if not args.dir:
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
  main()
