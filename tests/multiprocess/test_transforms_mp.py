"""Restore through transforms across real ``jax.distributed`` processes.

Each launch starts N fresh Python processes on 127.0.0.1 (K CPU devices
each, gloo collectives) running ``transforms_worker.py`` on real TensorStore
arrays on the local disk; the launches are chained:

1. 2 processes x 4 devices save a model with one subtree per layer (and
   again through save transforms).
2. 4 x 2 restore it onto a scan-over-layers model (rename + stack_layers +
   fallback_state) with other PartitionSpecs, bit-exact per addressable
   shard; each process also restores from its own copy of the checkpoint
   from which every array it does not need was deleted (including the
   layers its devices do not hold). They save the stacked state as step 2.
3. 1 x 8 restore step 1 the same way (stack_layers + assignment_map +
   fallback) and step 2 back onto the per-layer model (unstack_layers).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import ckpt
from tests.multiprocess import launch as launch_lib
from ckpt.format import tree
from tests.multiprocess import transforms_worker as worker

WORKER = "tests.multiprocess.transforms_worker"
STACKED = {"params/layers/attn/w", "params/layers/mlp/w",
           "params/layers/mlp/b", "params/embedding/table",
           "params/norm/scale", "step"}


def launch(config: dict, num_processes: int, devices_per_process: int):
  result = worker.Saved if config["op"] == "save" else worker.Restored
  return launch_lib.launch(WORKER, config, num_processes, devices_per_process,
                           result=result)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
  root = tmp_path_factory.mktemp("transforms_mp")
  return {name: str(root / name)
          for name in ("dir", "dir_xf", "dir2", "scratch_4x2", "scratch_1x8")}


@pytest.fixture(scope="module")
def saved_2x4(dirs):
  return launch({"op": "save", "dir": dirs["dir"], "dir_xf": dirs["dir_xf"]},
                2, 4)


@pytest.fixture(scope="module")
def restored_4x2(dirs, saved_2x4):
  del saved_2x4
  return launch({"op": "restore", "dir": dirs["dir"], "dir2": dirs["dir2"],
                 "scratch": dirs["scratch_4x2"], "resave": True}, 4, 2)


@pytest.fixture(scope="module")
def restored_1x8(dirs, restored_4x2):
  del restored_4x2
  return launch({"op": "restore", "dir": dirs["dir"], "dir2": dirs["dir2"],
                 "scratch": dirs["scratch_1x8"], "unstack": True}, 1, 8)


def assert_clean(part, what: str, want_checked: set[str]) -> None:
  assert part.mismatches == [], f"{what}:\n" + "\n".join(part.mismatches)
  assert set(part.checked) == want_checked, what


def test_save_transforms_in_a_multiprocess_save(saved_2x4, dirs):
  assert all(r.steps == [1] for r in saved_2x4)
  loaded = ckpt.load(dirs["dir_xf"])
  names = {tree.path_str(p) for p in tree.unnest(loaded)}
  assert not any(n.startswith("opt/") for n in names), names
  assert "params/embedding/table" in names and "params/embed/table" not in names
  assert np.array_equal(loaded["params"]["embedding"]["table"],
                        worker.truth("params/embed/table"))
  assert np.array_equal(loaded["params"]["layers_3"]["mlp"]["b"],
                        worker.truth("params/layers_3/mlp/b"))
  assert not (pathlib.Path(dirs["dir_xf"]) / "checkpoint_1" / "opt").exists()


@pytest.mark.parametrize("layout", ["4x2", "1x8"])
def test_restore_through_transforms_and_fallback_bit_exact(
    request, layout):
  results = request.getfixturevalue(f"restored_{layout}")
  for r in results:
    assert r.layout == layout
    who = f"process {r.process} ({layout})"
    assert_clean(r.own, f"{who} own", STACKED)
    # Restoring the Checkpointer's own latest step is resuming; path= is not.
    assert r.own.is_resuming == [True], who
    assert_clean(r.copy, f"{who} copy", STACKED)
    assert r.copy.is_resuming == [False], who


def test_each_process_reads_only_the_layers_it_holds(restored_4x2):
  # The layer axis of attn/w and mlp/b is split over the processes: each
  # process holds one layer, so its private copy lacked the other three
  # layers of both, and its restore still matched bit for bit.
  held_attn = []
  for r in restored_4x2:
    held = r.copy.held
    assert len(held["attn/w"]) == 1 and len(held["mlp/b"]) == 1, held
    assert held["mlp/w"] == list(range(worker.LAYERS)), held
    held_attn += held["attn/w"]
    deleted = set(r.copy.deleted)
    assert {"opt", "params/head"} <= deleted
    for leaf in ("attn/w", "mlp/b"):
      gone = {f"params/layers_{i}/{leaf}" for i in range(worker.LAYERS)
              if i not in held[leaf]}
      assert len(gone) == worker.LAYERS - 1 and gone <= deleted, deleted
  assert sorted(held_attn) == list(range(worker.LAYERS))


def test_single_process_deletes_only_unwanted_leaves(restored_1x8):
  (r,) = restored_1x8
  assert sorted(r.copy.deleted) == ["opt", "params/head"]


@pytest.mark.parametrize("layout", ["4x2", "1x8"])
def test_lazy_restore_reads_onto_the_target_shardings(request, layout):
  for r in request.getfixturevalue(f"restored_{layout}"):
    assert_clean(r.lazy, f"process {r.process} ({layout}) lazy",
                 STACKED)


@pytest.mark.parametrize("layout", [
    "4x2",
    "1x8"])
def test_lazy_restore_gives_lazy_leaves_only(request, layout):
  for r in request.getfixturevalue(f"restored_{layout}"):
    assert r.lazy.not_lazy == [], r.lazy
    assert set(r.lazy.lazy_leaves) == STACKED - {"step"}


@pytest.mark.parametrize("layout", ["4x2", "1x8"])
def test_a_missing_layer_a_process_needs_fails_naming_it(request, layout):
  for r in request.getfixturevalue(f"restored_{layout}"):
    corrupt = r.corrupt
    error = corrupt.restore.error
    assert error is not None, (
        f"process {r.process}: restore succeeded without {corrupt.deleted}")
    assert error.type == "CorruptCheckpointError", error
    assert f"'{corrupt.deleted}'" in error.msg, corrupt


def test_stacked_checkpoint_from_4_processes_unstacks_on_1x8(restored_4x2,
                                                             restored_1x8,
                                                             dirs):
  assert all(r.resave.steps == [2] for r in restored_4x2)
  (r,) = restored_1x8
  want = {f"params/layers_{i}/{leaf}" for i in range(worker.LAYERS)
          for leaf in worker.LAYER_LEAVES}
  want |= {"params/embed/table", "params/norm/scale"}
  assert_clean(r.unstack, "1x8 unstack", want)
  assert r.unstack.is_resuming == [True]
  # What the 4 processes wrote is the stacked tree (norm included).
  loaded = ckpt.load(dirs["dir2"])
  assert loaded["params"]["layers"]["attn"]["w"].shape == (
      worker.LAYERS, 32, 64)
  assert np.array_equal(loaded["params"]["norm"]["scale"],
                        worker.truth("params/norm/scale"))


def test_worker_check_detects_a_wrong_layer():
  # The per-shard comparison must be able to fail: layer order matters.
  good = worker.truth("params/layers/attn/w")
  swapped = good[[1, 0, 2, 3]]
  assert worker.same_bits(good, worker.truth("params/layers/attn/w"))
  assert not worker.same_bits(swapped, good)
  assert len({worker.seed_of(p) for p in worker.saved_leaves()}) == len(
      worker.saved_leaves())
