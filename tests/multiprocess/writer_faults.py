"""The writer process with a kill point, for the crash-point tests of
``writer="process"`` (tests/multiprocess/test_writer_mp.py).

Its trainer runs it in place of ckpt.save.writer_main
(``writer_client.WRITER_MODULE``) with ``KILL_AT`` in its environment; it
installs the kill point in this process only, then is the writer:

- ``before rename``: process 0's writer SIGKILLs itself inside its commit,
  the index and the marker written into the attempt, before the rename;
- ``after record``: the writer SIGKILLs itself once its record is written
  (its part durable: process 0's writer may commit);
- ``before record``: the writer SIGKILLs itself as it is about to write
  its record (its arrays and files written: the step must not commit).
"""

from __future__ import annotations

import os
import signal
import sys

from ckpt.commit import rename
from ckpt.commit import through_storage
from ckpt.save import writer_main

KILL_AT = "CKPT_TEST_WRITER_KILL_AT"


def _die(*args, **kwargs) -> None:
  del args, kwargs
  os.kill(os.getpid(), signal.SIGKILL)


def install(point: str) -> None:
  if point == "before rename":
    rename.fsync_dir = _die
  elif point == "after record":
    plain = through_storage.write_record

    def record_then_die(*args, **kwargs):
      plain(*args, **kwargs)
      _die()

    through_storage.write_record = record_then_die
  elif point == "before record":
    through_storage.write_record = _die
  else:
    raise ValueError(f"unknown kill point {point!r}")


if __name__ == "__main__":
  install(os.environ[KILL_AT])
  sys.exit(writer_main.main(sys.argv))
