"""format="ocdbt": many small leaves make a few files; the merge is one
database that references the per-process data without copying it."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorstore as ts

import ckpt
from ckpt.shards import merge_groups
from ckpt.store import ocdbt
from ckpt.store import urls

N_LEAVES = 10_000
MAX_FILES = 48  # "a few dozen"


def small_leaves(n: int) -> dict:
  """``n`` leaves of 1 to 4 KiB, each with its own values."""
  rng = np.random.default_rng(0)
  out: dict = {}
  for i in range(n):
    out.setdefault(f"layer_{i // 100}", {})[f"p{i % 100}"] = (
        rng.standard_normal(256 * (1 + i % 4), np.float32))
  return out


def files_under(path) -> list[str]:
  return [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]


def test_10000_small_leaves_make_a_few_dozen_files(tmp_path):
  state = small_leaves(N_LEAVES)
  with ckpt.Checkpointer(tmp_path, format="ocdbt", async_save=False) as ckptr:
    ckptr.save(1, state)
    stats = ckptr.last_save_stats
  assert stats.array_leaves == N_LEAVES
  files = files_under(tmp_path)
  assert len(files) <= MAX_FILES, (len(files), sorted(files))
  got = ckpt.load(tmp_path)
  for layer, params in state.items():
    for k, v in params.items():
      assert got[layer][k].tobytes() == v.tobytes(), f"{layer}/{k}"


def test_merge_references_the_data_without_copying(tmp_path):
  """The step's database holds every key of the per-process ones, and the
  merge wrote only B+tree nodes (the data stays in ocdbt.process_*/d/)."""
  state = {f"w{i}": np.full((512, 256), i, np.float32) for i in range(4)}
  with ckpt.Checkpointer(tmp_path, format="ocdbt", async_save=False) as ckptr:
    ckptr.save(1, state)
    context = ckptr.storage.context()
  step = tmp_path / "checkpoint_1"
  step_spec = urls.kvstore_for_url(str(step))[0]
  merged = ts.KvStore.open(ocdbt.database(step_spec), context=context).result()
  child = ts.KvStore.open(ocdbt.process_database(step_spec, 0),
                          context=context).result()
  keys = sorted(merged.list().result())
  assert keys == sorted(child.list().result())
  assert b"w3/zarr.json" in keys
  data = sum(os.path.getsize(f) for f in files_under(step / "ocdbt.process_0"))
  merged_only = sum(os.path.getsize(f) for f in files_under(step / "d"))
  assert data > 2 << 20  # the 2 MiB of arrays
  assert merged_only < 64 << 10, merged_only


def test_merge_groups_split_large_steps_only():
  # One merge is enough: no groups (the step's root database, as before).
  assert merge_groups.assign_groups([10] * 100, 64, keys_per_merge=5000) == [None] * 100
  # 100 arrays of 10 keys, at most 250 keys per merge, 64 processes: 4
  # groups of contiguous arrays with 250 keys each.
  groups = merge_groups.assign_groups([10] * 100, 64, keys_per_merge=250)
  assert groups == sorted(groups) and set(groups) == {0, 1, 2, 3}
  assert [groups.count(g) for g in range(4)] == [25] * 4
  # Never more groups than processes (each merges at most its share).
  assert set(merge_groups.assign_groups([10] * 100, 2, keys_per_merge=10)) == {0, 1}
  assert ocdbt.merges_of(1, 2, 5) == [1, 3]
  # A group's directory name comes from a checked int only.
  with pytest.raises(ckpt.CheckpointError):
    ocdbt.group_base({"driver": "file", "path": "/x/"}, "../../etc")
