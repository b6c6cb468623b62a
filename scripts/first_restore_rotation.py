"""Benchmark: Orbax, ckpt and raw files one after the other in ONE process,
rotating which goes first (issue 37, item 1).

Usage (from the repository root):
  python -m scripts.first_restore_rotation [--preset leaves64_f32_1g]
      [--rounds 3] [--systems orbax,ckpt,raw] [--out F] [--dir D] [--fresh]

The state is the preset's (default: 64 leaves of 1024x4096 random float32
over a (data=2, model=4) mesh of 8 CPU devices), built once. Each round
runs every system once, round r starting with system r, each in a fresh
directory:

- orbax: one ``StandardCheckpointer``: ``save``, then ``restore`` onto the
  same shardings;
- ckpt: one ``Checkpointer(async_save=False)``: ``save(1)``, then
  ``restore(step=1, target=<same shardings>)``, then a restore onto the
  preset's other mesh ((4, 2) by default);
- raw: each distinct shard written with ``tofile`` + ``fsync`` on 8 threads,
  read back with ``np.fromfile`` and ``device_put`` (systems.RawSystem).

Unlike scripts/bench.py (a fresh process per system), the systems share
one process, as a job that restores right after it saves does: whoever
goes first pays the process's first-use costs (page faults of fresh host
memory, compilation, thread pools), so the rotation shows each system both
first and later. Figures per operation: wall, CPU and system seconds and
minor page faults (scripts/benchlib/measure.py; fresh host memory shows in
the last two), per round and as medians (min-max); for ckpt also how many
restore buffers probed their first huge page and how many found it slow
(ckpt/restore/hostmem.py). The first round's restores are checked bit for
bit, outside the timing.

``--fresh``: every system saves once in this process; then each round
restores each system's checkpoint (onto the same shardings) in a fresh
child process, rotating who goes first, after dropping the page cache
(``sync; echo 3 > /proc/sys/vm/drop_caches``: root only, else said so and
the cache is kept): the first restore of a process whose memory has been
free for long, read from the disk.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from typing import Any, Callable  # noqa: E402

from scripts.benchlib import measure  # noqa: E402
from scripts.benchlib import presets  # noqa: E402
from scripts.benchlib import report  # noqa: E402
from scripts.benchlib import systems as systems_lib  # noqa: E402
from scripts.benchlib import workers  # noqa: E402

SYSTEMS = ("orbax", "ckpt", "raw")
ROWS = [(f"{op}_{fig}", f"{label}: {what}")
        for op, label in (("save", "save"), ("restore_same", "restore, same"),
                          ("restore_other", "restore, other mesh"))
        for fig, what in (("s", "wall (s)"), ("cpu_s", "CPU (s)"),
                          ("sys_s", "system CPU (s)"),
                          ("minflt", "minor faults"))]
ROWS += [(f"{op}_{fig}", f"{label}: {what}")
         for op, label in (("restore_same", "restore, same"),
                           ("restore_other", "restore, other mesh"))
         for fig, what in (("probes", "huge-page probes"),
                           ("slow_probes", "slow probes"))]
# An operation is (its name, a function of the state's targets).
Protocol = list[tuple[str, Callable[[], Any]]]


def orbax_protocol(path: str, state, targets) -> Protocol:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  c = ocp.StandardCheckpointer()
  where = os.path.join(path, "1")

  def save():
    c.save(where, state)
    c.wait_until_finished()

  return [("save", save),
          ("restore_same", lambda: c.restore(where, targets["same"])),
          ("close", c.close)]


def ckpt_protocol(path: str, state, targets) -> Protocol:
  import ckpt  # pylint: disable=g-import-not-at-top
  c = ckpt.Checkpointer(path, async_save=False)
  return [("save", lambda: c.save(1, state)),
          ("restore_same", lambda: c.restore(step=1, target=targets["same"])),
          ("restore_other", lambda: c.restore(step=1,
                                              target=targets["other"])),
          ("close", c.close)]


def raw_protocol(path: str, state, targets) -> Protocol:
  raw = systems_lib.RawSystem({"threads": 8})
  return [("save", lambda: raw.save(path, state)),
          ("restore_same", lambda: raw.restore(path, targets["same"]))]


def restore_only(name: str, path: str, targets) -> Callable[[], Any]:
  """The system's restore onto the same shardings of what it saved in
  ``path`` (another process's save: ``--fresh``)."""
  if name == "orbax":
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    return lambda: ocp.StandardCheckpointer().restore(
        os.path.join(path, "1"), targets["same"])
  if name == "ckpt":
    import ckpt  # pylint: disable=g-import-not-at-top
    return lambda: ckpt.Checkpointer(path).restore(step=1,
                                                   target=targets["same"])
  return lambda: systems_lib.RawSystem({"threads": 8}).restore(
      path, targets["same"])


PROTOCOLS = {"orbax": orbax_protocol, "ckpt": ckpt_protocol,
             "raw": raw_protocol}


def run_protocol(name: str, path: str, preset, state, targets,
                 verify: bool) -> dict[str, float]:
  """The system's operations in order; their figures (``timed``)."""
  out = {}
  for op, fn in PROTOCOLS[name](path, state, targets):
    if op == "close":
      fn()
      continue
    value, figures = timed(fn)
    out.update({f"{op}_{k}": v for k, v in figures.items()})
    if verify and op.startswith("restore"):
      presets.verify(preset, value)
    del value
  return out


def timed(fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
  """``fn()``, ready, and its figures (with the ckpt restore buffers'
  huge-page probes it made)."""
  import jax  # pylint: disable=g-import-not-at-top
  from ckpt.restore import hostmem  # pylint: disable=g-import-not-at-top
  probes, slow = hostmem.CHOOSER.probes, hostmem.CHOOSER.slow
  with measure.measure(interval_s=0) as m:
    value = fn()
    jax.block_until_ready(value)
  figures = {"s": m.wall_s, "cpu_s": m.cpu_s, "sys_s": m.sys_s,
             "minflt": m.minor_faults}
  if hostmem.CHOOSER.probes > probes:
    figures["probes"] = hostmem.CHOOSER.probes - probes
    figures["slow_probes"] = hostmem.CHOOSER.slow - slow
  return value, figures


def child_restore(name: str, path: str, preset_name: str) -> int:
  """``--restore-in-child``: one restore in this fresh process; its figures
  as one JSON line on stdout."""
  preset = presets.load_preset(preset_name)
  topo = presets.Topology(preset)
  targets = {"same": presets.abstract_state(preset, topo.save_mesh)}
  value, figures = timed(restore_only(name, path, targets))
  presets.verify(preset, value)
  print("FIGURES " + json.dumps(
      {f"restore_same_{k}": v for k, v in figures.items()}), flush=True)
  return 0


def fresh_rounds(names: list[str], where: str, preset, state, targets,
                 rounds: int, preset_name: str, huge_pages: str,
                 raw: dict) -> list[dict]:
  """``--fresh``: each system saves here once; each round restores each
  checkpoint in a fresh process, after the page cache is dropped."""
  paths = {}
  for s in names:
    paths[s] = os.path.join(where, s)
    for op, fn in PROTOCOLS[s](paths[s], state, targets):
      if op in ("save", "close"):
        fn()
  out = []
  for r in range(rounds):
    line = []
    for s in workers.rotated(names, r):
      dropped = measure.drop_page_cache()
      proc = subprocess.run(
          [sys.executable, "-m", "scripts.first_restore_rotation",
           "--preset", preset_name, "--huge-pages", huge_pages,
           "--restore-in-child", s, paths[s]],
          capture_output=True, text=True, timeout=1800, check=True)
      [figures] = [json.loads(l.split(" ", 1)[1])
                   for l in proc.stdout.splitlines()
                   if l.startswith("FIGURES ")]
      report.record(raw, s, figures)
      out.append({"round": r, "system": s, "cache_dropped": dropped,
                  **figures})
      line.append(f"{s} restore {figures['restore_same_s']:.2f} s"
                  f"{'' if dropped else ' (page cache kept: not root)'}")
    print(f"  fresh round {r + 1}: " + "; ".join(line), flush=True)
  return out


def main(argv: list[str] | None = None) -> int:
  parser = report.arg_parser(__doc__)
  parser.add_argument("--preset", default="leaves64_f32_1g",
                      help="a name in configs/ or a path to a JSON preset")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--systems", default=",".join(SYSTEMS),
                      help=f"comma-separated, from {','.join(SYSTEMS)} "
                      "(orbax is skipped if not installed)")
  parser.add_argument("--out", default=None, help="the JSON report")
  parser.add_argument("--dir", default=None,
                      help="where checkpoints are written (default: a new "
                      "temporary directory, removed at the end)")
  parser.add_argument("--fresh", action="store_true",
                      help="restore each round in fresh processes after "
                      "dropping the page cache (see above)")
  parser.add_argument("--huge-pages", choices=("auto", "on", "off"),
                      default="auto",
                      help="ckpt.restore.hostmem.HUGE_PAGES: None (auto), "
                      "True or False, for an A/B of the restore's buffers")
  parser.add_argument("--restore-in-child", nargs=2, metavar=("SYSTEM", "PATH"),
                      help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  from ckpt.restore import hostmem  # pylint: disable=g-import-not-at-top
  hostmem.HUGE_PAGES = {"auto": None, "on": True, "off": False}[
      args.huge_pages]
  if args.restore_in_child:
    return child_restore(*args.restore_in_child, args.preset)
  names = [s for s in args.systems.split(",") if s]
  for s in names:
    if s not in SYSTEMS:
      parser.error(f"unknown system {s!r}; expected some of {SYSTEMS}")
  if "orbax" in names and not systems_lib.orbax_installed():
    names.remove("orbax")
    print("orbax skipped: orbax-checkpoint is not installed", flush=True)
  preset = presets.load_preset(args.preset)
  topo = presets.Topology(preset)
  state = presets.build_state(preset, topo)
  targets = {"same": presets.abstract_state(preset, topo.save_mesh),
             "other": presets.abstract_state(preset, topo.other_mesh)}
  print(f"{preset['name']}: {len(presets.leaf_specs(preset))} leaves, "
        f"{presets.state_nbytes(preset) / report.MiB:,.0f} MiB, "
        f"{args.rounds} rounds of {', '.join(names)} in one process",
        flush=True)
  raw: dict[str, dict[str, list]] = {}
  rounds = []
  with workers.workdir(args.dir) as where:
    if args.fresh:
      rounds = fresh_rounds(names, where, preset, state, targets, args.rounds,
                            args.preset, args.huge_pages, raw)
    for r in range(0 if args.fresh else args.rounds):
      order = workers.rotated(names, r)
      line = []
      for s in order:
        path = os.path.join(where, f"{s}-r{r}")
        figures = run_protocol(s, path, preset, state, targets, r == 0)
        shutil.rmtree(path, ignore_errors=True)
        report.record(raw, s, figures)
        rounds.append({"round": r, "system": s, "position": order.index(s),
                       **figures})
        line.append(f"{s} save {figures['save_s']:.2f} s, restore "
                    f"{figures['restore_same_s']:.2f} s")
      print(f"  round {r + 1}: " + "; ".join(line), flush=True)
  figures = {s: {k: report.summarize(v) for k, v in raw[s].items()}
             for s in names}
  print()
  print(report.figure_table(figures, ROWS))
  if args.out:
    report.write(args.out, {
        "preset": preset["name"], "rounds": rounds, "systems": figures,
        "fresh": args.fresh, "huge_pages": args.huge_pages, "machine": report.machine(),
        "command": report.command("scripts.first_restore_rotation", argv)})
  return 0


if __name__ == "__main__":
  sys.exit(main())
