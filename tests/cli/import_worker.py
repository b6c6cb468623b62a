"""One process of a job that imports an Orbax checkpoint (test_orbax_import).

Run through ``ckpt.local_cluster``: every process calls
``convert.import_checkpoint`` on the same source and destination, so each
reads and writes its share of every leaf. Scenario "one_bad": process 1 is
given a source that does not exist; every process records the error it
raised and how long it took to raise it.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> None:
  from ckpt import local_cluster  # pylint: disable=g-import-not-at-top
  cfg = local_cluster.init_from_env()
  config = json.loads(argv[1])
  from ckpt import convert  # pylint: disable=g-import-not-at-top
  src = config["src"]
  if config["scenario"] == "one_bad" and cfg["process_id"] == 1:
    src += "-missing"
  t0 = time.monotonic()
  try:
    report = convert.import_checkpoint(
        src, config["dst"], config["step"], concurrent_bytes=1 << 20,
        barrier_timeout_s=config["timeout"])
    out = {"report": report.to_json(), "msg": None}
  except Exception as e:  # pylint: disable=broad-except
    out = {"report": None, "msg": f"{type(e).__name__}: {e}"}
  out["elapsed"] = time.monotonic() - t0
  local_cluster.write_result(out)


if __name__ == "__main__":
  main(sys.argv)
