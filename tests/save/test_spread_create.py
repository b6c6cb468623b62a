"""Array creation is dealt over the processes (save._open_arrays): each
array's metadata is written by exactly one process, none creates more than
its share, and with format "ocdbt" process 0 creates them all."""

import asyncio
import os

import numpy as np
import pytest
import tensorstore as ts

from ckpt.save import leaves as leaves_lib
from ckpt.save import write as save_lib
from ckpt.store import storage as storage_lib

N_ARRAYS = 10


@pytest.fixture(autouse=True, scope="module")
def _arrays(arrays_only):
  """Small leaves kept as arrays (not packed): this is about creating arrays."""


def _state():
  return {f"a{i}": np.full((4, 4), i, np.float32) for i in range(N_ARRAYS)}


def _metadata(root, fmt):
  name = ".zarray" if fmt == "zarr" else "zarr.json"
  return {d for d in os.listdir(root)
          if os.path.exists(os.path.join(root, d, name))}


def _open(root, fmt, process, count):
  opts = leaves_lib.SaveOptions(storage_format=fmt, inline_max_bytes=0)
  plan = leaves_lib.plan_save(_state(), opts, process=process,
                            process_count=count)
  kv = {"driver": "file", "path": str(root) + "/"}
  arrays = asyncio.run(save_lib._open_arrays(  # pylint: disable=protected-access
      plan, kv, ts.Context({storage_lib.OCDBT_CACHE_POOL: {}}), process,
      count))
  return plan, arrays


@pytest.mark.parametrize("fmt", ["zarr", "zarr3"])
def test_each_process_creates_its_share(tmp_path, fmt):
  created = []
  for p in range(4):
    before = _metadata(tmp_path, fmt) if tmp_path.exists() else set()
    _open(tmp_path, fmt, p, 4)
    created.append(_metadata(tmp_path, fmt) - before)
  # Each array exactly once, 2 or 3 per process (10 over 4).
  assert sorted(n for c in created for n in c) == sorted(_state())
  assert sorted(len(c) for c in created) == [2, 2, 3, 3]


def test_one_process_creates_every_array(tmp_path):
  _open(tmp_path, "zarr", 0, 1)
  assert _metadata(tmp_path, "zarr") == set(_state())


def test_ocdbt_process_0_creates_every_array(tmp_path):
  # Process 1 opens (in its own database) only the arrays it writes a
  # part of (the host arrays are replicated over the 4 processes).
  plan, got = _open(tmp_path, "ocdbt", 1, 4)
  assert set(got) == {w.leaf for w in plan.writes} != set(range(N_ARRAYS))
  _, got = _open(tmp_path, "ocdbt", 0, 4)
  assert len(got) == N_ARRAYS
