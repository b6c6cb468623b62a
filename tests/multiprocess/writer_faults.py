"""The writer process with a kill point, for the crash-point tests of
``writer="process"`` (tests/multiprocess/test_writer_mp.py,
tests/objectstore/test_commit.py).

Its trainer runs it in place of ckpt.save.writer_main
(``writer_client.WRITER_MODULE``) with ``KILL_AT`` in its environment
(and, optionally, ``KILL_STEP``: the point fires only in the save of that
step); it installs the kill point in this process only, then is the writer:

- ``before rename``: process 0's writer SIGKILLs itself inside its commit,
  the index and the marker written into the attempt, before the rename;
- ``after record``: the writer SIGKILLs itself once its record is written
  (its part durable: process 0's writer may commit);
- ``before record``: the writer SIGKILLs itself as it is about to write
  its record (its arrays and files written: the step must not commit);
- ``mid write``: the writer SIGKILLs itself as it starts writing its third
  box (some of its boxes are in the store, some are not);
- ``after index``: process 0's writer SIGKILLs itself right after it wrote
  the index on a bucket (every record in, OCDBT databases merged), before
  the commit marker;
- ``trainer after index``: at that same point process 0's writer SIGKILLs
  its trainer instead, waits until it is dead, and goes on (the commit).
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time

import psutil

from ckpt.commit import rename
from ckpt.commit import through_storage
from ckpt.save import writer_main
from ckpt.store import names
from ckpt.store import storage as storage_lib

KILL_AT = "CKPT_TEST_WRITER_KILL_AT"
KILL_STEP = "CKPT_TEST_WRITER_KILL_STEP"
BOX = 3  # "mid write": the box it dies at


def _die(*args, **kwargs) -> None:
  del args, kwargs
  sys.stdout.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def _kill_trainer(trainer: int) -> None:
  """SIGKILLs the trainer and waits (bounded) until it is dead."""
  os.kill(trainer, signal.SIGKILL)
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline:
    try:
      if psutil.Process(trainer).status() == psutil.STATUS_ZOMBIE:
        return
    except psutil.NoSuchProcess:
      return
    time.sleep(0.01)
  raise RuntimeError(f"the trainer {trainer} did not die")


def install(point: str, step: int | None, trainer: int) -> None:
  def at_step(save_step: int) -> bool:
    return step is None or save_step == step

  if point == "before rename":
    rename.fsync_dir = _die
  elif point == "after record":
    plain = through_storage.write_record

    def record_then_die(*args, **kwargs):
      plain(*args, **kwargs)
      if at_step(args[1]):
        _die()

    through_storage.write_record = record_then_die
  elif point == "before record":
    plain_record = through_storage.write_record

    def die_or_record(*args, **kwargs):
      if at_step(args[1]):
        _die()
      plain_record(*args, **kwargs)

    through_storage.write_record = die_or_record
  elif point == "mid write":
    plain_box, boxes = writer_main.Save._write_box, itertools.count(1)  # pylint: disable=protected-access

    def write_or_die(self, m, packed=False):
      if not packed and at_step(self.step) and next(boxes) == BOX:
        print(f"writer of process {self.process}: SIGKILL as it writes box "
              f"{BOX} of step {self.step}", flush=True)
        _die()
      return plain_box(self, m, packed)

    writer_main.Save._write_box = write_or_die  # pylint: disable=protected-access
  elif point in ("after index", "trainer after index"):
    plain_write = storage_lib.Storage.write_bytes

    def write_then_kill(self, rel, data):
      plain_write(self, rel, data)
      if rel.endswith("/" + names.INDEX_NAME) and at_step(
          names.parse_step(rel.split("/")[0])):
        if point == "after index":
          print(f"writer: SIGKILL after writing {rel}", flush=True)
          _die()
        print(f"writer: SIGKILL of its trainer after writing {rel}",
              flush=True)
        _kill_trainer(trainer)

    storage_lib.Storage.write_bytes = write_then_kill
  else:
    raise ValueError(f"unknown kill point {point!r}")


if __name__ == "__main__":
  install(os.environ[KILL_AT],
          int(os.environ[KILL_STEP]) if os.environ.get(KILL_STEP) else None,
          int(sys.argv[2]))
  sys.exit(writer_main.main(sys.argv))
