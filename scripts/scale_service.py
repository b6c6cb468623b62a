"""What the coordination service costs process 0 per process and call.

``python -m scripts.scale_service --processes 4 32`` starts N local
``jax.distributed`` processes (one CPU device each; this file is also the
worker) that do nothing but ``--rounds`` rounds of each kind: an idle
sleep of 20 ms, a barrier, a key-value set of 100 bytes by every process
then a barrier, a directory get by every process then a barrier. Prints
the CPU milliseconds (``time.process_time``, every thread) process 0 and
process 1 spend per round: process 0 runs the service, so what its figure
grows by from one N to the next, over the added processes, is what one
call of one process costs it (docs/at-scale.md#process-0-per-process).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
KINDS = ("idle", "barrier", "set", "dirget")


def worker(conf: dict) -> None:
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  local_cluster.init_from_env()
  import jax  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import process as mh  # pylint: disable=g-import-not-at-top
  pid = jax.process_index()
  client = mh.coordination_client()
  rounds = conf["rounds"]
  out = {}

  def phase(name, body):
    mh.barrier(f"svc/{name}/pre")
    c0 = time.process_time()
    for r in range(rounds):
      body(r)
    out[name] = 1e3 * (time.process_time() - c0) / rounds
    mh.barrier(f"svc/{name}/post")

  phase("idle", lambda r: time.sleep(0.02))
  phase("barrier", lambda r: mh.barrier(f"svc/b/{r}"))
  phase("set", lambda r: (client.key_value_set(f"svc/s/{r}/{pid}", "x" * 100),
                          mh.barrier(f"svc/sb/{r}")))
  phase("dirget", lambda r: (client.key_value_dir_get(f"svc/s/{r}/"),
                             mh.barrier(f"svc/db/{r}")))
  local_cluster.write_result({"process": pid, **out})


def main(argv=None) -> int:
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=int, nargs="+", default=[4, 32])
  parser.add_argument("--rounds", type=int, default=30)
  args = parser.parse_args(argv)
  print("| N | process | " + " | ".join(f"{k} CPU ms/round" for k in KINDS)
        + " |")
  print("|---:|---:|" + "---:|" * len(KINDS))
  for n in args.processes:
    res = local_cluster.check(local_cluster.run(
        "scripts.scale_service", {"rounds": args.rounds}, num_processes=n,
        devices_per_process=1, timeout_s=900, cwd=str(ROOT)))
    for r in res[:2]:
      print(f"| {n} | {r['process']} | "
            + " | ".join(f"{r[k]:.2f}" for k in KINDS) + " |", flush=True)
  load = os.getloadavg()
  print(f"\n(load average {load[0]:.1f} on {os.cpu_count()} cores)")
  return 0


if __name__ == "__main__":
  from ckpt.multihost import local_cluster as _lc  # pylint: disable=g-import-not-at-top
  if os.environ.get(_lc.ENV_CONFIG) and len(sys.argv) == 2:
    worker(json.loads(sys.argv[1]))
    sys.exit(0)
  sys.exit(main())
