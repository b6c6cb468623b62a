"""load_safetensors across 2 real ``jax.distributed`` processes x 4 CPU
devices (tests/multiprocess/hf_worker.py) from sharded safetensors files on
the local disk: each process reads its half of the model, bit-exact on the
target's shardings; one process failing makes both raise, naming it, and so do
processes given different sources."""

from __future__ import annotations

import shutil

import pytest

from tests.hf import llama
from tests.multiprocess import launch as launch_lib

WORKER = "tests.multiprocess.hf_worker"
SEED = 5


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
  d = str(tmp_path_factory.mktemp("hf_mp"))
  llama.write(d, llama.tensors(seed=SEED), shards=3)
  return d


def launch(config: dict) -> list[dict]:
  return launch_lib.launch(WORKER, {"seed": SEED, **config}, 2, 4)


def test_each_process_reads_its_half_bit_exact(src):
  out = launch({"src": src, "layout": "shard", "budget": 8 << 10})
  total = out[0]["total"]
  for r in out:
    assert r["error"] is None and r["bad"] == [], r
    # Every leaf is split over the two processes: each asks for exactly
    # half of the model's bytes, as row blocks of the files' tensors (one
    # ranged read per box; lm_head's columns are its HF rows), except the
    # embedding, split over its columns: the whole rows that cover the
    # process's 4 boxes, i.e. the whole tensor, fetched once (not once per
    # device).
    assert r["bytes_read"] == total // 2, r
    embed = llama.VOCAB * llama.HIDDEN * 2
    assert r["rows_fetched"] == total // 2 - embed // 2 + embed, r
    assert 0 < r["peak"] <= 8 << 10, r


def test_one_process_failing_makes_both_raise_naming_it(src):
  out = launch({"src": src, "layout": "shard", "bad_process": 1})
  assert "does not exist" in out[1]["error"], out[1]
  assert "failed on process(es) [1]" in out[0]["error"], out[0]
  assert all(r["seconds"] < 60 for r in out), out


def test_processes_loading_different_sources_all_raise(src, tmp_path):
  other = str(tmp_path / "copy")
  shutil.copytree(src, other)
  out = launch({"src": src, "layout": "shard", "other_process": 0,
                "other_src": other})
  for r in out:
    assert "the processes are not doing the same thing" in r["error"], r
    assert "Every process must load the same source" in r["error"], r
