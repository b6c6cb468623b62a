"""What the tests of the face's parts share: a directory whose committed
steps a real Checkpointer wrote (the parts are then tested alone on it)."""

from __future__ import annotations

import numpy as np
import pytest

import ckpt
from ckpt.store import storage as storage_lib


def save_steps(directory, steps, metrics=None, **kwargs) -> None:
  """Commits ``steps`` in ``directory`` (one small leaf each), with
  ``metrics[step]`` if given; no retention."""
  with ckpt.Checkpointer(directory, async_save=False, **kwargs) as c:
    for s in steps:
      c.save(s, {"w": np.full((4,), s, np.float32)},
             metrics=(metrics or {}).get(s))


@pytest.fixture
def storage(tmp_path) -> storage_lib.Storage:
  return storage_lib.Storage(str(tmp_path / "ckpts"))
