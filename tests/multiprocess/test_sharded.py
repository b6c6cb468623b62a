"""Sharded save and restore across real ``jax.distributed`` processes.

Each launch starts N fresh Python processes on 127.0.0.1 (K CPU devices
each, gloo collectives) running ``sharded_worker.py``; they write and read
real TensorStore arrays on the local disk. The launches are chained so that
each one pays jax's start-up once:

1. 2 processes x 4 devices save the state as step 1, three times: format
   zarr; zarr3 with async_save; zarr3 with zstd and a byte budget smaller
   than single boxes.
2. 4 x 2 restore step 1 onto another mesh and other PartitionSpecs, check
   every addressable shard bit for bit, and save what they restored as
   step 2 (a checkpoint written by four processes).
3. 1 x 8 restore steps 1, 2 and 3 (step 2 saved again by 4 x 2, reusing
   its plan) onto a third mesh, and also with
   ``target=None`` and ``ckpt.load``.
"""

from __future__ import annotations

import math
import os
import pathlib

import pytest

from tests.multiprocess import launch as launch_lib
from tests.multiprocess import sharded_worker as worker

WORKER = "tests.multiprocess.sharded_worker"
# The checkpoints each job writes or reads: name -> Checkpointer options.
# "zarr3" saves asynchronously (save returns once staged); "tight" has a
# byte budget smaller than many single boxes (the 2 MiB halves of
# ema/table), which must each take the whole budget and proceed.
CKPTS = {
    "zarr": {"format": "zarr"},
    "zarr3": {"format": "zarr3", "async_save": True},
    "tight": {"format": "zarr3", "compression": "zstd",
              "concurrent_bytes": 256 << 10},
}
# Every process writes within this factor of an equal share of the bytes.
BALANCE = 1.5


def launch(config: dict, num_processes: int, devices_per_process: int):
  result = worker.Saved if config["op"] == "save" else worker.Restored
  return launch_lib.launch(WORKER, config, num_processes, devices_per_process,
                           result=result)


def all_leaf_paths() -> set[str]:
  return set(worker.ARRAYS) | set(worker.VALUES)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, dict]:
  root = tmp_path_factory.mktemp("sharded")
  return {name: {**opts, "dir": str(root / name)}
          for name, opts in CKPTS.items()}


@pytest.fixture(scope="module")
def saved_2x4(ckpts):
  return launch({"op": "save", "ckpts": ckpts, "step": 1}, 2, 4)


@pytest.fixture(scope="module")
def restored_4x2(ckpts, saved_2x4):
  del saved_2x4
  return launch({"op": "restore", "ckpts": ckpts, "steps": [1],
                 "resave": 2, "resave_again": True}, 4, 2)


@pytest.fixture(scope="module")
def restored_1x8(ckpts, restored_4x2):
  del restored_4x2
  return launch({"op": "restore", "ckpts": ckpts, "steps": [1, 2, 3]}, 1, 8)


def assert_balanced(written: list[int], what: str) -> None:
  """Each chunk written exactly once, no process far from an equal share."""
  total = worker.stored_bytes()
  assert sum(written) == total, (
      f"{what}: processes wrote {written} = {sum(written)} bytes; the state "
      f"has {total} bytes of stored arrays (each chunk must be written once)")
  share = total / len(written)
  for p, n in enumerate(written):
    assert share / BALANCE <= n <= share * BALANCE, (
        f"{what}: process {p} wrote {n} bytes, the equal share is "
        f"{share:.0f} (all: {written})")


def test_state_has_replicated_leaves_of_a_few_mb():
  # The balance checks below only mean something if the replicated data is
  # large enough that writing it all on process 0 would break them.
  big = [p for p, s in worker.ARRAYS.items()
         if (s["save"] is None or s["save"] == worker.P())
         and s["dtype"].itemsize * math.prod(s["shape"]) >= 1 << 20]
  assert "ema/table" in big and "data/tokens" in big
  assert worker.stored_bytes() > 8 << 20
  # Distinct seeds, so a leaf restored into another leaf's place is caught.
  assert len({worker.seed_of(p) for p in worker.ARRAYS}) == len(worker.ARRAYS)


@pytest.mark.parametrize("name", CKPTS)
def test_save_2x4_on_disk(saved_2x4, ckpts, name):
  for r in saved_2x4:
    assert r.layout == "2x4"
    assert r.ckpts[name].steps == [1], r
  root = pathlib.Path(ckpts[name]["dir"])
  assert sorted(os.listdir(root)) == ["checkpoint_1"]  # no tmp-* left over
  step = root / "checkpoint_1"
  assert (step / "index.msgpack").is_file()
  meta = ".zarray" if ckpts[name]["format"] == "zarr" else "zarr.json"
  for leaf in ("params/embed/table", "opt/mu/layers/0/kernel", "ema/table",
               "data/buffer", "data/tokens"):
    assert (step / leaf / meta).is_file(), f"{leaf}/{meta} missing"
  # Small leaves go inline in the index, not into arrays.
  assert not (step / "opt" / "count").exists()
  assert not (step / "data" / "tiny").exists()
  # Leaves of at most 64 KiB (biases, the 64 KiB bf16 head kernels, the
  # mask) are packed (ckpt/save/pack.py): no array of their own; both processes
  # wrote boxes of them into their own pack, with its table.
  for leaf in ("params/layers/0/bias", "opt/nu/head/kernel", "data/mask"):
    assert not (step / leaf).exists(), leaf
  for p in (0, 1):
    assert (step / ".packs" / f"{p}.msgpack").is_file()
    assert (step / ".packs" / f"{p}.0.bin").stat().st_size > 0


@pytest.mark.parametrize("name", CKPTS)
def test_save_2x4_bytes_per_process_balanced(saved_2x4, name):
  assert_balanced([r.ckpts[name].bytes_written for r in saved_2x4],
                  f"save 2x4 {name}")
  budget = CKPTS[name].get("concurrent_bytes", 1 << 30)
  for r in saved_2x4:
    stats = r.ckpts[name]
    assert stats.array_leaves + stats.inline_leaves == len(all_leaf_paths())
    assert 0 < stats.peak_bytes_in_flight <= budget, stats
    assert stats.blocking_s > 0 and stats.total_s > 0
    if CKPTS[name].get("async_save"):  # save returned once staged
      assert stats.blocking_s <= stats.total_s


@pytest.mark.parametrize("name", CKPTS)
def test_restore_4x2_bit_exact(restored_4x2, name):
  for r in restored_4x2:
    assert r.layout == "4x2"
    res = r.ckpts[name]
    assert res.mismatches == [], (
        f"process {r.process}:\n" + "\n".join(res.mismatches))
    assert set(res.checked["1"]) == all_leaf_paths()


@pytest.mark.parametrize("name", CKPTS)
def test_resave_from_4x2_balanced(restored_4x2, name):
  for r in restored_4x2:
    assert r.ckpts[name].resave.saved is True
    assert r.ckpts[name].resave.steps == [1, 2]
  assert_balanced([r.ckpts[name].resave.bytes_written for r in restored_4x2],
                  f"re-save 4x2 {name}")


@pytest.mark.parametrize("name", CKPTS)
def test_second_resave_from_4x2_reuses_the_plan(restored_4x2, name):
  """Step 3 saves the same restored state as step 2: every process reuses
  its plan (plans no leaf anew), still writes an equal share, and step 3
  restores bit for bit on 1 x 8 (test_restore_1x8_bit_exact...)."""
  leaves = len(all_leaf_paths())
  for r in restored_4x2:
    assert r.ckpts[name].resave.planned_leaves == leaves, r.ckpts[name]
    assert r.ckpts[name].resave_again.saved is True
    assert r.ckpts[name].resave_again.planned_leaves == 0, r.ckpts[name]
  assert_balanced([r.ckpts[name].resave_again.bytes_written
                   for r in restored_4x2], f"second re-save 4x2 {name}")


@pytest.mark.parametrize("name", CKPTS)
def test_restore_1x8_bit_exact_and_target_none(restored_1x8, name):
  (r,) = restored_1x8
  assert r.layout == "1x8"
  res = r.ckpts[name]
  assert res.steps == [1, 2, 3]
  assert res.mismatches == [], "\n".join(res.mismatches)
  for step in ("1", "2", "3"):
    assert set(res.checked[step]) == all_leaf_paths()


def test_worker_comparison_detects_a_flipped_bit():
  # The checks above compare bit patterns; make sure they can fail.
  truth = worker.global_value("params/head/kernel")
  flipped = truth.copy()
  flipped.view("uint16")[3, 5] ^= 1
  assert worker.same_bits(truth, truth.copy())
  assert not worker.same_bits(flipped, truth)
  bad: list[str] = []
  worker.compare_plain({"a": flipped, "b": (1, "x")},
                       {"a": truth, "b": (1, "y")}, "t", bad)
  assert len(bad) == 2, bad
