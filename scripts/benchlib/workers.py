"""Fresh worker processes: each builds a preset's state once, then runs ops.

A benchmark runs every system in ONE process, the limit included, so that
all are timed in the same process and round (issue 47); only an A/B label
``ckpt@PATH`` (ckpt imported from another tree) gets a process of its own.
``Workers`` starts one per such group, one at a time (building the state
takes the cores); each worker (``python -m scripts.benchlib.workers``)
builds the preset's random state on its CPU devices into a ``Session``,
then reads operations from stdin, one JSON line each, and answers each with
one line. An operation names the function that runs it and the system:
``{"fn": "scripts.bench:save", "system": "ckpt", ...}`` calls
``save(session, op)`` of that module, which returns a JSON-ready dict.

``run_job`` runs a list of operations in a local ``jax.distributed`` job
instead: every process builds the state and runs every operation, after a
barrier of its own, and returns its results.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

from scripts.benchlib import presets
from scripts.benchlib import systems as systems_lib

RESULT_PREFIX = "@@bench "
ROOT = presets.ROOT


class Session:
  """What one worker holds: the preset, its state, targets and systems
  (``system``: one label, or several joined by commas)."""

  def __init__(self, system: str, preset_file: str):
    import jax  # pylint: disable=g-import-not-at-top
    self.jax = jax
    t0 = time.perf_counter()
    self.label = system
    self.preset = presets.load_preset(preset_file)
    self.systems = {s: systems_lib.make_system(s, self.preset)
                    for s in system.split(",")}
    self.system = self.systems[system.split(",")[0]]
    self.topo = presets.Topology(self.preset)
    self.state = presets.build_state(self.preset, self.topo)
    self.targets = {
        "same": presets.abstract_state(self.preset, self.topo.save_mesh),
        "other": presets.abstract_state(self.preset, self.topo.other_mesh)}
    self.build_s = time.perf_counter() - t0
    self.cache: dict[str, Any] = {}  # what an op keeps for the next ones

  def run(self, op: dict[str, Any]) -> dict[str, Any]:
    if "system" in op:  # the op's system, for the op's function
      self.system = self.systems[op["system"]]
    module, name = op["fn"].split(":")
    return getattr(importlib.import_module(module), name)(self, op)


def _emit(value: dict[str, Any]) -> None:
  sys.stdout.write(RESULT_PREFIX + json.dumps(value) + "\n")
  sys.stdout.flush()


def serve(system: str, preset_file: str) -> int:
  """A worker on stdin/stdout: one JSON operation per line, one result each."""
  try:
    session = Session(system, preset_file)
  except Exception as e:  # pylint: disable=broad-except
    _emit({"error": f"{type(e).__name__}: {e}"})
    raise
  _emit({"ready": True, "build_s": session.build_s,
         "devices": session.jax.device_count()})
  for line in sys.stdin:
    op = json.loads(line)
    if op.get("fn") == "quit":
      break
    try:
      _emit(session.run(op))
    except Exception as e:  # pylint: disable=broad-except
      import traceback  # pylint: disable=g-import-not-at-top
      traceback.print_exc()
      _emit({"error": f"{type(e).__name__}: {e}"})
  return 0


class WorkerProcess:
  """A worker subprocess: one system, its own memory, fed over stdin."""

  def __init__(self, system: str, preset_file: str, devices: int,
               log_dir: str):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices}"
                        ).strip()
    if "@" in system:  # an A/B run: this worker imports ckpt from elsewhere
      env["PYTHONPATH"] = os.pathsep.join(
          [system.split("@", 1)[1], str(ROOT)] +
          ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    self.system = system
    self.log_path = os.path.join(
        log_dir, f"{system.replace('@', '-').replace('/', '_')[:100]}.log")
    self._log = open(self.log_path, "w")
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.benchlib.workers", system,
         preset_file], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=self._log, text=True, env=env, cwd=str(ROOT))
    self.ready = self._read()

  def _read(self) -> dict[str, Any]:
    while True:
      line = self.proc.stdout.readline()
      if not line:
        self.proc.wait()
        raise RuntimeError(f"{self.system} worker exited "
                           f"({self.proc.returncode}); its log:\n{self._tail()}")
      if line.startswith(RESULT_PREFIX):
        value = json.loads(line[len(RESULT_PREFIX):])
        if "error" in value:
          raise RuntimeError(f"{self.system} worker: {value['error']}\n"
                             f"{self._tail()}")
        return value

  def _tail(self) -> str:
    self._log.flush()
    with open(self.log_path) as f:
      return f.read()[-6000:]

  def run(self, op: dict[str, Any]) -> dict[str, Any]:
    self.proc.stdin.write(json.dumps(op) + "\n")
    self.proc.stdin.flush()
    return self._read()

  def close(self) -> None:
    if self.proc.poll() is None:
      with contextlib.suppress(Exception):
        self.proc.stdin.write(json.dumps({"fn": "quit"}) + "\n")
        self.proc.stdin.close()
      try:
        self.proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self._log.close()


def groups(systems: list[str]) -> dict[str, list[str]]:
  """The systems that share a worker process: every label but ``ckpt@PATH``
  in one (``""``), each ``ckpt@PATH`` in its own (its ``PATH``)."""
  out: dict[str, list[str]] = {}
  for s in systems:
    out.setdefault(s.split("@", 1)[1] if "@" in s else "", []).append(s)
  return out


class Workers:
  """The worker processes of ``groups(systems)``, for a ``with`` block;
  ``procs[system]`` is the worker that holds ``system``."""

  def __init__(self, systems: list[str], preset_file: str, devices: int = 8,
               shared: bool = True):
    self.systems, self.preset_file, self.devices = systems, preset_file, devices
    self.shared = shared  # False: one process per system
    self.procs: dict[str, WorkerProcess] = {}
    self.info: dict[str, Any] = {}

  def __enter__(self) -> "Workers":
    self._logs = tempfile.mkdtemp(prefix="ckpt-bench-logs-")
    try:
      # One at a time: building the state takes the cores.
      for labels in (groups(self.systems).values() if self.shared else
                     [[s] for s in self.systems]):
        t0 = time.perf_counter()
        proc = WorkerProcess(",".join(labels), self.preset_file, self.devices,
                             self._logs)
        for s in labels:
          self.procs[s] = proc
          self.info[s] = {**proc.ready, "start_s": time.perf_counter() - t0,
                          "process": labels}
        print(f"  {', '.join(labels)}: worker ready, state built in "
              f"{proc.ready['build_s']:.1f} s", flush=True)
    except BaseException:
      self.__exit__()
      raise
    return self

  def rounds(self, runs: int) -> Iterator[tuple[int, str, WorkerProcess]]:
    """(run, system, worker), every system in every run, the order rotated
    (run r starts with system r) so that drifts hit every system alike."""
    for r in range(runs):
      for s in rotated(self.systems, r):
        yield r, s, self.procs[s]

  def __exit__(self, *exc) -> None:
    for w in {id(w): w for w in self.procs.values()}.values():
      w.close()
    shutil.rmtree(self._logs, ignore_errors=True)


def rotated(items: list, r: int) -> list:
  """``items`` starting at ``r`` (mod their number)."""
  k = r % len(items)
  return list(items[k:]) + list(items[:k])


def run_job(system: str, preset_file: str, ops: list[dict[str, Any]], *,
            processes: int, devices_per_process: int,
            timeout_s: float) -> list[dict[str, Any]]:
  """Runs ``ops`` in a local jax.distributed job of ``processes`` processes;
  returns each process's ``{"build_s", "results": [one per op]}``."""
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  return local_cluster.check(local_cluster.run(
      "scripts.benchlib.workers",
      {"system": system, "preset": preset_file, "ops": ops},
      num_processes=processes, devices_per_process=devices_per_process,
      timeout_s=timeout_s, cwd=str(ROOT)))


def _job_process(config: dict[str, Any]) -> int:
  """One process of ``run_job``'s job."""
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as multihost  # pylint: disable=g-import-not-at-top
  local_cluster.init_from_env()
  session = Session(config["system"], config["preset"])
  results = []
  for i, op in enumerate(config["ops"]):
    multihost.barrier(f"bench/{i}", what=f"benchmark operation {i}")
    results.append(session.run(op))
  multihost.barrier("bench/end", what="the end of the benchmark")
  local_cluster.write_result({"build_s": session.build_s, "results": results})
  return 0


# ---- what the benchmarks of presets in worker processes share ------------------


def add_flags(parser: argparse.ArgumentParser) -> None:
  """The flags of every benchmark that runs a preset in worker processes."""
  parser.add_argument("--preset", default="smoke",
                      help="a name in configs/ or a path to a JSON preset")
  parser.add_argument("--runs", type=int, default=None,
                      help="runs per system (default: the preset's, else 3)")
  parser.add_argument("--systems", default=None,
                      help=f"comma-separated, from "
                      f"{','.join(systems_lib.SYSTEMS)} (default: all; orbax "
                      "is skipped if not installed; ckpt@PATH: ckpt imported "
                      "from PATH, for A/B runs)")
  parser.add_argument("--out", default=None, help="the JSON report")
  parser.add_argument("--dir", default=None,
                      help="where checkpoints are written (default: a new "
                      "temporary directory, removed at the end)")
  parser.add_argument("--devices", type=int, default=8,
                      help="CPU devices of each worker process")


def pick_systems(parser, args, allowed) -> tuple[list[str], list[str]]:
  """The systems of ``--systems`` (default: ``allowed``; orbax left out when
  it is not installed, with a note) and ``args.runs`` resolved."""
  if args.runs is None:
    args.runs = presets.load_preset(args.preset).get("runs", 3)
  systems = [s.strip() for s in (args.systems or ",".join(allowed)).split(",")
             if s.strip()]
  for s in systems:
    if systems_lib.system_kind(s) not in allowed:
      parser.error(f"unknown system {s!r}; expected some of {allowed} "
                   "(ckpt@PATH: ckpt imported from PATH, for A/B runs)")
  notes = []
  if "orbax" in systems and not systems_lib.orbax_installed():
    if args.systems:
      parser.error("orbax-checkpoint is not installed: pip install -e "
                   "'.[bench]', or leave orbax out of --systems")
    systems.remove("orbax")
    notes.append("orbax skipped: orbax-checkpoint is not installed "
                 "(pip install -e '.[bench]')")
  return systems, notes


class workdir:  # pylint: disable=invalid-name
  """``path`` (made), or a temporary directory removed at the end."""

  def __init__(self, path: str | None):
    self.path = path

  def __enter__(self) -> str:
    self.own = self.path is None
    self.where = (tempfile.mkdtemp(prefix="ckpt-bench-") if self.own else
                  os.path.abspath(self.path))
    os.makedirs(self.where, exist_ok=True)
    return self.where

  def __exit__(self, *exc) -> None:
    if self.own:
      shutil.rmtree(self.where, ignore_errors=True)


if __name__ == "__main__":
  from ckpt.multihost import local_cluster as _lc  # pylint: disable=g-import-not-at-top
  if os.environ.get(_lc.ENV_CONFIG) and len(sys.argv) == 2:
    sys.exit(_job_process(json.loads(sys.argv[1])))
  sys.exit(serve(sys.argv[1], sys.argv[2]))
