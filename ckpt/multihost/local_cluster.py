"""Run N real ``jax.distributed`` processes on this machine (127.0.0.1).

Used by the multi-process tests, the demo and the benchmark: each process is
a fresh Python interpreter with K CPU devices, joined through a coordinator
on a free loopback port, with gloo CPU collectives. It is a real multi-host
job in miniature, not a simulation.

A worker is ``python -m <module> <json config>``; it calls
``init_from_env()`` first and writes its result as JSON to ``result_path()``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

ENV_CONFIG = "CKPT_CLUSTER"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class ProcessResult:
  process_id: int
  returncode: int
  output: str
  result: Any  # what the worker wrote with write_result, or None


class Cluster:
  """N worker processes of one job; see ``start``."""

  def __init__(self, procs, outdir: str):
    self.procs = procs  # [(Popen, log file)]
    self.outdir = outdir

  def pids(self) -> list[int]:
    return [p.pid for p, _ in self.procs]

  def poll(self) -> list[int | None]:
    return [p.poll() for p, _ in self.procs]

  def kill(self, process_id: int, sig: int = 9) -> None:
    p = self.procs[process_id][0]
    if p.poll() is None:
      p.send_signal(sig)

  def wait_for_files(self, paths, timeout_s: float) -> None:
    """Blocks (bounded) until every path exists; raises RuntimeError with
    every process's output if time runs out or a process exits first."""
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
      if (time.monotonic() > deadline or
          any(c is not None for c in self.poll())):
        results = self.wait(0, grace_s=0)
        raise RuntimeError(
            f"the processes did not reach {[os.fspath(p) for p in paths]}:\n"
            + "\n".join(f"--- process {r.process_id} (exit {r.returncode}) "
                         f"---\n{r.output[-3000:]}" for r in results))
      time.sleep(0.02)

  def wait(self, timeout_s: float, *, grace_s: float = 5.0) -> list[ProcessResult]:
    """Waits (bounded) for all to exit. If one fails or time runs out, the
    others get ``grace_s`` and are then killed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      codes = self.poll()
      if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
        break
      time.sleep(0.05)
    grace = time.monotonic() + grace_s
    while time.monotonic() < grace and any(c is None for c in self.poll()):
      time.sleep(0.05)
    results = []
    for pid, (p, log) in enumerate(self.procs):
      if p.poll() is None:
        p.kill()
      p.wait()
      log.seek(0)
      path = os.path.join(self.outdir, f"result_{pid}.json")
      result = None
      if os.path.exists(path):
        with open(path) as f:
          result = json.load(f)
      results.append(ProcessResult(pid, p.returncode, log.read(), result))
      log.close()
    # Logs and results are in ``results`` now: the directory goes (a test
    # suite starts hundreds of jobs).
    shutil.rmtree(self.outdir, ignore_errors=True)
    return results


def start(module: str, config: dict, *, num_processes: int,
          devices_per_process: int, extra_env: dict | None = None,
          cwd: str | None = None,
          prefix: Callable[[int], list[str]] | None = None) -> Cluster:
  """Starts ``python -m module <config json>`` as N processes of one job.

  ``prefix(process_id)``: a command that process runs under (it ends by
  executing its arguments), e.g. ``unshare --uts ...`` to give it its own
  host name."""
  port = free_port()
  outdir = tempfile.mkdtemp(prefix="ckpt-cluster-")
  procs = []
  for pid in range(num_processes):
    env = dict(os.environ, **(extra_env or {}))
    env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count="
                        f"{devices_per_process}")
    env["JAX_PLATFORMS"] = "cpu"
    env[ENV_CONFIG] = json.dumps({
        "process_id": pid, "num_processes": num_processes,
        "coordinator": f"127.0.0.1:{port}",
        "result": os.path.join(outdir, f"result_{pid}.json")})
    log = open(os.path.join(outdir, f"log_{pid}.txt"), "w+")
    procs.append((subprocess.Popen(
        [*(prefix(pid) if prefix else ()), sys.executable, "-m", module,
         json.dumps(config)], env=env,
        stdout=log, stderr=subprocess.STDOUT, cwd=cwd), log))
  return Cluster(procs, outdir)


def run(module: str, config: dict, *, num_processes: int,
        devices_per_process: int, timeout_s: float = 300.0,
        extra_env: dict | None = None, cwd: str | None = None,
        prefix: Callable[[int], list[str]] | None = None
        ) -> list[ProcessResult]:
  """Starts the processes, waits (bounded), and returns each one's result."""
  return start(module, config, num_processes=num_processes,
               devices_per_process=devices_per_process, extra_env=extra_env,
               cwd=cwd, prefix=prefix).wait(timeout_s)


def check(results: list[ProcessResult]) -> list[Any]:
  """The workers' results; raises with every process's output if any failed."""
  bad = [r for r in results if r.returncode != 0 or r.result is None]
  if bad:
    text = "\n".join(f"--- process {r.process_id} (exit {r.returncode}) ---\n"
                     f"{r.output[-4000:]}" for r in results)
    raise RuntimeError(f"{len(bad)} of {len(results)} processes failed:\n{text}")
  return [r.result for r in results]


def config_from_env() -> dict:
  return json.loads(os.environ[ENV_CONFIG])


def init_from_env() -> dict:
  """In a worker: joins the cluster. Call before any other jax use."""
  cfg = config_from_env()
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=cfg["coordinator"],
                             num_processes=cfg["num_processes"],
                             process_id=cfg["process_id"],
                             initialization_timeout=120)
  return cfg


def write_result(value: Any) -> None:
  path = config_from_env()["result"]
  with open(path + ".partial", "w") as f:
    json.dump(value, f)
  os.replace(path + ".partial", path)
