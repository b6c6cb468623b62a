"""Benchmark: Orbax, ckpt and raw files one after the other in ONE process,
rotating which goes first (issue 37, item 1).

Usage (from the repository root):
  python -m scripts.first_restore_rotation [--preset leaves64_f32_1g]
      [--rounds 3] [--systems orbax,ckpt,raw] [--out F] [--dir D]

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
first and later. Figures per operation: wall and CPU seconds
(scripts/benchlib/measure.py), per round and as medians (min-max); the
first round's restores are checked bit for bit, outside the timing.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402
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
        for fig, what in (("s", "wall (s)"), ("cpu_s", "CPU (s)"))]
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


PROTOCOLS = {"orbax": orbax_protocol, "ckpt": ckpt_protocol,
             "raw": raw_protocol}


def run_protocol(name: str, path: str, preset, state, targets,
                 verify: bool) -> dict[str, float]:
  """The system's operations in order; their wall and CPU seconds."""
  import jax  # pylint: disable=g-import-not-at-top
  out = {}
  for op, fn in PROTOCOLS[name](path, state, targets):
    if op == "close":
      fn()
      continue
    with measure.measure(interval_s=0) as m:
      value = fn()
      jax.block_until_ready(value)
    out[f"{op}_s"], out[f"{op}_cpu_s"] = m.wall_s, m.cpu_s
    if verify and op.startswith("restore"):
      presets.verify(preset, value)
    del value
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
  args = parser.parse_args(argv)
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
    for r in range(args.rounds):
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
        "machine": report.machine(),
        "command": report.command("scripts.first_restore_rotation", argv)})
  return 0


if __name__ == "__main__":
  sys.exit(main())
