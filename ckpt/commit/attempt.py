"""What both commit kinds share (ckpt/commit/strategy.py): the names of an
attempt's lease and directory prefix, the errors of a commit that cannot
happen, and directory fsync."""

from __future__ import annotations

import os
from typing import Protocol

from ckpt.commit import lease as lease_lib
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError

ATTEMPT_FILE = "attempt.json"
ATTEMPT_PREFIX = "attempt-"
# TensorStore's generation of a key that does not exist: a write with
# ``if_equal=NO_VALUE`` creates the key only if it is absent.
NO_VALUE = b"\x02"


class Cleaner(Protocol):
  """What preparing an attempt needs of ckpt/commit/cleanup.py (passed in:
  cleanup reads the steps through this module)."""

  def remove(self, storage: storage_lib.Storage, rel: str) -> None: ...

  def is_live(self, storage: storage_lib.Storage, rel: str, lease_s: float,
              seen: lease_lib.Sightings | None = None) -> bool | None: ...


def fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def removed_error(step: int, where: str, why: str) -> CheckpointError:
  return CheckpointError(
      f"cannot commit step {step}: its work was removed while the save was "
      f"running ({why}; another job's cleanup of abandoned saves, `ckpt gc`, "
      f"or a person?). Expected the lease {where}/{ATTEMPT_FILE} "
      "as this save last wrote it; nothing was committed and the existing "
      "checkpoints are untouched. Save again")


def committed_elsewhere(storage: storage_lib.Storage, step: int,
                        where: str) -> CheckpointError:
  return CheckpointError(
      f"cannot commit step {step} in {storage.url!r}: another attempt "
      f"committed it first; this attempt ({where}) was not committed")
