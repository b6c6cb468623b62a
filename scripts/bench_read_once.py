"""Benchmark: the multi-process restore figure of read once
(ckpt/restore/readonce.py), on the local disk and on S3.

Usage (from the repository root):
  python -m scripts.bench_read_once [--read-once-scale 8]
      [--read-once-budget BYTES] [--read-once-states aligned,awkward]
      [--stores disk,s3] [--process-counts 2,4] [--out F]

For each state (``--read-once-states``: READ_ONCE_STATES, both
``--read-once-scale`` times their base size), store (the local disk;
moto's S3 server, started here, behind a counting proxy) and process
count (``--process-counts``; 2 CPU devices each), one job saves the state,
then restores it (``--read-once-budget``: with that concurrent_bytes) with
read_once True, False, True, False: times are the second (warm: jit
compiled, TensorStore opened) restore of each policy, the slowest
process's ``last_restore_stats.total_s``. Bytes fetched: on S3 the bodies
of the GETs the proxy saw during that restore (counted at the store,
tests/objectstore/proxy.py); on the disk the bytes TensorStore's file
driver read, summed over the processes (its kvstore counter, read by the
worker around the restore: what each host's disk would serve without a
page cache shared between the processes). ``x stored``: over the bytes
of every object of the step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

from scripts.benchlib import presets
from scripts.benchlib import report

# The states: (worker module, its config, what it is).
READ_ONCE_STATES = {
    "aligned": ("tests.multiprocess.readonce_worker", {"format": "zarr"},
                "tests/multiprocess/readonce_worker.py: leaves replicated "
                "over every process, over 2, and fully sharded; every box "
                "a union of whole chunks"),
    "awkward": ("tests.multiprocess.fetch_worker", {"format": "zarr3"},
                "tests/multiprocess/fetch_worker.py: shapes that divide by "
                "neither the replica count nor their chunks, all replicated "
                "over every process"),
}
COLUMNS = [
    ("state", "state", "{}"), ("store", "store", "{}"),
    ("processes", "processes", "{}"), ("read once", "policy", "{}"),
    ("restore s (slowest)", "time_s", "{:.3f}"),
    ("exchange s", "exchange_s", "{:.3f}"),
    ("batches (read overlapped)", "batches_text", "{}"),
    ("MiB fetched per process", "per_process_text", "{}"),
    ("MiB fetched, all", "fetched_mib", "{:.1f}"),
    ("x stored", "x_stored", "{:.2f}"),
]


def run(args) -> list[dict[str, Any]]:
  """One row per (state, store, process count, policy): see the docstring."""
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  from tests.objectstore import proxy as proxy_lib  # pylint: disable=g-import-not-at-top
  from tests.objectstore import servers  # pylint: disable=g-import-not-at-top
  from tests.objectstore import storeutil  # pylint: disable=g-import-not-at-top
  rows = []
  work = tempfile.mkdtemp(prefix="ckpt-bench-ro-")
  moto = px = None
  counter = proxy_lib.HttpCounter()
  if "s3" in args.stores.split(","):
    moto = servers.start_moto(work)
    host, port = moto.endpoint.rsplit("//", 1)[1].split(":")
    px = proxy_lib.Proxy((host, int(port)), counter).start()
  policies = [True, False, True, False]
  try:
    for state in args.read_once_states.split(","):
      module, config, _ = READ_ONCE_STATES[state]
      for store in args.stores.split(","):
        for n in (int(c) for c in args.process_counts.split(",")):
          counter.reset()
          if store == "disk":
            url, env = tempfile.mkdtemp(dir=work) + "/ck", {}
          else:
            os.environ.update(moto.env)  # the listing below: direct
            url = servers.new_bucket(moto) + "/ck"
            env = {**moto.env, "AWS_ENDPOINT_URL": px.endpoint}
          out = local_cluster.check(local_cluster.run(
              module, {**config, "dir": url, "op": "both",
                       "scale": args.read_once_scale, "policies": policies,
                       **({"concurrent_bytes": args.read_once_budget}
                          if args.read_once_budget else {}),
                       **({"count_url": px.endpoint} if store == "s3" else {})},
              num_processes=n, devices_per_process=2, timeout_s=900,
              extra_env=env, cwd=str(presets.ROOT)))
          stored = _stored_bytes(url, storeutil)
          for i in (2, 3):  # the warm restore of each policy
            policy = str(policies[i])
            # by "<i>-<policy>" (fetch_worker) or policy (readonce_worker)
            recs = [r["restores"].get(f"{i}-{policy}",
                                      r["restores"].get(policy)) for r in out]
            st = [x["stats"] for x in recs]
            if store == "s3":
              _, bodies = counter.between(
                  "start" if i == 0 else f"{i - 1}-{policies[i - 1]}",
                  f"{i}-{policy}")
              fetched = sum(bodies.values())
            else:
              fetched = sum(x["ts_fetched"] for x in recs)
            rows.append({
                "state": state, "store": store, "processes": n,
                "read_once": policy == "True",
                "time_s": max(x["total_s"] for x in st),
                "exchange_s": max(x["exchange_s"] for x in st),
                "batches": max(x["batches"] for x in st),
                "overlapped": min(x.get("overlapped_batches", 0) for x in st),
                "bytes_read_per_process": [x["bytes_read"] for x in st],
                "fetched_per_process": [x["ts_fetched"] for x in recs],
                "fetched_total": fetched, "stored": stored,
                "bit_exact": not any(x["bad"] for x in recs)})
  finally:
    if px is not None:
      px.close()
      moto.stop()
    shutil.rmtree(work, ignore_errors=True)
  for r in rows:
    r["policy"] = "on" if r["read_once"] else "off"
    r["batches_text"] = f"{r['batches']} ({r['overlapped']})"
    r["per_process_text"] = "/".join(f"{b / 2**20:.1f}"
                                     for b in r["fetched_per_process"])
    r["fetched_mib"] = r["fetched_total"] / 2**20
    r["x_stored"] = r["fetched_total"] / r["stored"]
  return rows


def _stored_bytes(url: str, storeutil) -> int:
  """Bytes of every object (file) of step 1 under ``url``."""
  if "://" not in url:
    return sum(os.path.getsize(os.path.join(d, f))
               for d, _, files in os.walk(os.path.join(url, "checkpoint_1"))
               for f in files)
  store = storeutil.kvstore(url)
  return sum(len(store.read(k).result().value) for k in store.list().result()
             if k.decode().startswith("checkpoint_1/"))




def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=__doc__.split("\n\n", 1)[1])
  parser.add_argument("--read-once-scale", type=int, default=8,
                      help="state sizes in units of their base (aligned: "
                      "3.5 MiB; awkward: 3.2 MiB, an even scale rounded up "
                      "to odd)")
  parser.add_argument("--read-once-budget", type=int, default=None,
                      help="the restores' concurrent_bytes (default: the "
                      "workers' 1 GiB, one exchange batch); small: several "
                      "batches, read while exchanging")
  parser.add_argument("--read-once-states", default="aligned,awkward",
                      help=f"comma-separated, from {','.join(READ_ONCE_STATES)}")
  parser.add_argument("--stores", default="disk,s3",
                      help="comma-separated, from disk,s3")
  parser.add_argument("--process-counts", default="2,4",
                      help="comma-separated process counts")
  parser.add_argument("--out", default=None, help="the JSON report")
  args = parser.parse_args(argv)
  rows = run(args)
  table = report.markdown(COLUMNS, rows)
  print(table)
  if args.out:
    report.write(args.out, {"rows": rows, "table": table,
                            "command": report.command(
                                "scripts.bench_read_once", argv)})
  return 0


if __name__ == "__main__":
  sys.exit(main())
