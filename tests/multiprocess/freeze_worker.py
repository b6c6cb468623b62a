"""Worker: process 0 freezes (SIGSTOP) inside save(2); process 1 must raise
BarrierTimeoutError naming process 0 in bounded time (not wait until JAX's
heartbeat aborts it). ``first``: "frozen" (process 1 enters save(2) once
process 0 is stopped: its first call, a key-value set, meets a silent
service) or "waiting" (process 1 is in save(2) first, waiting at the
save round's barrier, when process 0 stops)."""

import json
import os
import signal
import sys
import time

from ckpt.multihost import local_cluster


def wait_for(path: str, limit_s: float = 60.0) -> None:
  end = time.monotonic() + limit_s
  while not os.path.exists(path):
    if time.monotonic() > end:
      raise RuntimeError(f"{path} never came")
    time.sleep(0.01)


def main():
  local_cluster.init_from_env()
  conf = json.loads(sys.argv[1])
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import ckpt  # pylint: disable=g-import-not-at-top

  sync, pid = conf["sync"], jax.process_index()
  c = ckpt.Checkpointer(conf["dir"], barrier_timeout_s=conf["timeout"])
  state = {"w": np.arange(1000, dtype=np.float32)}
  c.save(1, state)
  c.wait_until_finished()

  def freeze(tree):  # process 0, inside save(2), before its round
    if conf["first"] == "waiting":
      wait_for(os.path.join(sync, "go"))
    with open(os.path.join(sync, "freezing"), "w") as f:
      f.write(str(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)
    return tree

  if pid == 0:
    c.save(2, state, transforms=[freeze])
    return  # never reached: the test kills it
  if conf["first"] == "frozen":
    wait_for(os.path.join(sync, "stopped"))  # the test saw process 0 stop
  else:
    open(os.path.join(sync, "entering"), "w").close()
  try:
    c.save(2, state)
    c.wait_until_finished()
    out = {"type": None, "error": None}
  except Exception as e:  # pylint: disable=broad-except
    out = {"type": type(e).__name__, "error": str(e),
           "barrier_timeout": isinstance(e, ckpt.BarrierTimeoutError)}
  out.update(process=pid, at=time.time())
  local_cluster.write_result(out)
  # Not through JAX's shutdown (it would ask process 0's silent service).
  os._exit(0)


if __name__ == "__main__":
  main()
