"""load_safetensors across 2 real ``jax.distributed`` processes x 4 CPU
devices (tests/multiprocess/hf_worker.py) from sharded safetensors files on
the local disk: each process reads its half of the model, bit-exact on the
target's shardings; one process failing makes both raise, naming it, and so do
processes given different models (another path to the same one is fine)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tests.hf import llama
from tests.multiprocess import hf_worker
from tests.multiprocess import launch as launch_lib

WORKER = "tests.multiprocess.hf_worker"
SEED = 5


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
  d = str(tmp_path_factory.mktemp("hf_mp"))
  llama.write(d, llama.tensors(seed=SEED), shards=3)
  return d


def launch(config: dict) -> list[hf_worker.Result]:
  return launch_lib.launch(WORKER, {"seed": SEED, **config}, 2, 4,
                           result=hf_worker.Result)


def said(o) -> str:
  """What a call that raised raised, as "<type>: <message>"."""
  assert o.error is not None, o
  return f"{o.error.type}: {o.error.msg}"


def test_each_process_reads_its_half_bit_exact(src):
  out = launch({"src": src, "layout": "shard", "budget": 8 << 10})
  total = out[0].total
  for r in out:
    assert r.load.ok and r.loaded.bad == [], r
    # Every leaf is split over the two processes: each asks for exactly
    # half of the model's bytes, as row blocks of the files' tensors (one
    # ranged read per box; lm_head's columns are its HF rows), except the
    # embedding, split over its columns: the whole rows that cover the
    # process's 4 boxes, i.e. the whole tensor, fetched once (not once per
    # device).
    assert r.loaded.bytes_read == total // 2, r
    embed = llama.VOCAB * llama.HIDDEN * 2
    assert r.loaded.rows_fetched == total // 2 - embed // 2 + embed, r
    assert 0 < r.loaded.peak <= 8 << 10, r


def test_one_process_failing_makes_both_raise_naming_it(src):
  out = launch({"src": src, "layout": "shard", "bad_process": 1})
  assert "does not exist" in said(out[1].load), out[1]
  assert "failed on process(es) [1]" in said(out[0].load), out[0]
  assert all(r.load.seconds < 60 for r in out), out


def test_another_path_to_the_same_model_is_fine_another_model_is_not(
    src, tmp_path):
  # Process 0 loads a copy at another path (hosts with their own disks).
  same = str(tmp_path / "same")
  shutil.copytree(src, same)
  out = launch({"src": src, "layout": "shard", "other_process": 0,
                "other_src": same})
  assert all(r.load.ok and r.loaded.bad == [] for r in out), out
  # A model with one tensor in another dtype: every process raises.
  t = llama.tensors(seed=SEED)
  t["model.norm.weight"] = t["model.norm.weight"].astype(np.float32)
  llama.write(str(tmp_path / "other"), t, shards=3)
  out = launch({"src": src, "layout": "shard", "other_process": 0,
                "other_src": str(tmp_path / "other")})
  for r in out:
    assert "the processes are not doing the same thing" in said(r.load), r
    assert "Every process must load the same tensors" in said(r.load), r
