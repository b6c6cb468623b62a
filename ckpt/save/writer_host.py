"""How the writer process (ckpt/save/writer_main.py) lives beside its
trainer: at a lower priority (``lower_priority``), and watching for the
trainer's death even when its end of the socket stays open
(``watch_parent``)."""

from __future__ import annotations

import os
import select
import socket
import time

from ckpt.save import handover


def watch_parent(channel: handover.Channel, trainer: int) -> None:
  """The trainer's death seen even when its end of the socket stays open
  (a child it forked holds a copy): once what it sent was read, the socket
  is shut and ``serve`` sees EOF."""
  while os.getppid() == trainer:
    time.sleep(0.5)
  while select.select([channel.sock], [], [], 0)[0]:
    time.sleep(0.2)  # its last messages (or its EOF) are being read
  try:
    channel.sock.shutdown(socket.SHUT_RD)
  except OSError:
    pass


def lower_priority(nice: int) -> None:
  """Every thread of this process (and each it starts: a thread inherits
  its creator's) at nice value ``nice``, never higher than now."""
  try:
    tids = [int(t) for t in os.listdir("/proc/self/task")]
  except OSError:
    tids = [os.getpid()]
  for tid in tids:
    try:
      if os.getpriority(os.PRIO_PROCESS, tid) < nice:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
      pass  # gone meanwhile, or not allowed: the priority stays
