"""Worker: process 0 freezes (SIGSTOP) inside save(2); process 1 must raise
BarrierTimeoutError naming process 0 in bounded time (not wait until JAX's
heartbeat aborts it). ``first``: "frozen" (process 1 enters save(2) once
process 0 is stopped: its first call, a key-value set, meets a silent
service) or "waiting" (process 1 is in save(2) first, waiting at the
save round's barrier, when process 0 stops) or "restore" (process 0
stops inside a resume, in a restore transform, once process 1 has posted
its part of the restore's next round and waits at its barrier)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

from tests.multiprocess import worker
from tests.multiprocess.worker import Outcome


@dataclasses.dataclass(frozen=True)
class Result:
  """Process 1's (process 0 is killed frozen)."""
  process: int
  call: Outcome           # its save(2) or resume
  barrier_timeout: bool   # the error is a ckpt.BarrierTimeoutError
  at: float               # time.time() when the call ended


def wait_for(path: str, limit_s: float = 60.0) -> None:
  end = time.monotonic() + limit_s
  while not os.path.exists(path):
    if time.monotonic() > end:
      raise RuntimeError(f"{path} never came")
    time.sleep(0.01)


def run(conf: dict) -> None:
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

  def freeze_in_restore(tree, target, *, is_resuming):
    del target, is_resuming
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    client = distributed.global_state.client
    end = time.monotonic() + 60
    while not any(k.endswith("/verified/in/1")
                  for k, _ in client.key_value_dir_get("ckpt/")):
      if time.monotonic() > end:
        raise RuntimeError("process 1 never posted its part of the round")
      time.sleep(0.01)
    return freeze(tree)

  if conf["first"] == "restore":
    if pid == 0:
      c.restore(transforms=[freeze_in_restore])
      return  # never reached: the test kills it
    call = c.restore
  elif pid == 0:
    c.save(2, state, transforms=[freeze])
    return  # never reached: the test kills it
  else:
    def call():
      c.save(2, state)
      c.wait_until_finished()
  if conf["first"] == "frozen":
    wait_for(os.path.join(sync, "stopped"))  # the test saw process 0 stop
  else:
    open(os.path.join(sync, "entering"), "w").close()
  raised = []

  def noted():
    try:
      call()
    except Exception as e:  # pylint: disable=broad-except
      raised.append(e)
      raise
  got = worker.timed(noted)
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  local_cluster.write_result(worker.encode(Result(
      pid, got, any(isinstance(e, ckpt.BarrierTimeoutError) for e in raised),
      time.time())))
  # Not through JAX's shutdown (it would ask process 0's silent service).
  os._exit(0)


if __name__ == "__main__":
  worker.main(run)
