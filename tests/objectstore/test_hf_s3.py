"""load_safetensors and export_safetensors on moto's S3: ranged reads from
a bucket, read once across 2 real processes, a set exported into a bucket,
and a hostile header refused there too."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

import ckpt
from ckpt.errors import CorruptCheckpointError
from ckpt.store import storage as storage_lib
from ckpt.store import storemeter
from tests.hf import llama
from tests.multiprocess import hf_worker
from tests.multiprocess import launch as launch_lib

SEED = 9


def upload(local_dir: str, url: str) -> None:
  storage = storage_lib.Storage(url)
  for name in sorted(os.listdir(local_dir)):
    with open(os.path.join(local_dir, name), "rb") as f:
      storage.write_bytes(name, f.read())


@pytest.fixture
def model_url(s3_bucket, tmp_path) -> str:
  llama.write(str(tmp_path / "m"), llama.tensors(seed=SEED), shards=3)
  upload(str(tmp_path / "m"), f"{s3_bucket}/llama")
  return f"{s3_bucket}/llama"


def test_load_from_a_bucket_reads_the_model_once(model_url):
  t = llama.tensors(seed=SEED)
  meter = storemeter.Meter()
  with meter:
    got = ckpt.load_safetensors(model_url, target=None)
  assert all(np.array_equal(got[k], v) for k, v in t.items())
  total = sum(v.nbytes for v in t.values())
  # The data once, plus the index JSON and the 3 headers (a few KiB).
  assert total <= meter.value <= total + (16 << 10), meter.value
  tgt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                     llama.nested(llama.expected(t)))
  got = ckpt.load_safetensors(f"{model_url}/model.safetensors.index.json",
                              target=tgt, names=llama.NAMES)
  assert np.array_equal(got["params"]["layers"]["mlp"]["up"]["kernel"],
                        llama.expected(t)["params/layers/mlp/up/kernel"])


def test_two_processes_read_a_replicated_model_once(model_url):
  out = launch_lib.launch("tests.multiprocess.hf_worker",
                          {"seed": SEED, "src": model_url,
                           "layout": "replicate"}, 2, 4,
                          result=hf_worker.Result)
  total = out[0].total
  for r in out:
    assert r.load.ok and r.loaded.bad == [], r
    # Every leaf is held whole by both processes; read once, each reads
    # half of it (its part of the split) and the parts are exchanged.
    assert r.loaded.bytes_read == total // 2, r
    assert r.loaded.fetched <= total // 2 + (16 << 10), r


def test_export_into_a_bucket_and_back(s3_bucket, tmp_path):
  root = str(tmp_path / "ck")
  t = llama.tensors(seed=SEED)
  params = llama.nested(llama.expected(t))
  with ckpt.Checkpointer(root, async_save=False) as c:
    c.save(1, params)
  out = f"{s3_bucket}/export"
  report = ckpt.export_safetensors(root, out, names=llama.NAMES,
                                   max_shard_bytes=32 << 10)
  assert len(report.files) > 1
  index = json.loads(storage_lib.Storage(out).read_bytes(
      "model.safetensors.index.json"))
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in t.values())
  got = ckpt.load_safetensors(out, target=None)
  assert sorted(got) == sorted(t)
  assert all(np.array_equal(got[k], v) for k, v in t.items())


def test_a_header_claiming_more_than_the_object_holds(s3_bucket):
  doc = json.dumps({"w": {"dtype": "F32", "shape": [1 << 20, 1 << 20],
                          "data_offsets": [0, 4 << 40]}}).encode()
  storage_lib.Storage(f"{s3_bucket}/bad").write_bytes(
      "m.safetensors", len(doc).to_bytes(8, "little") + doc + bytes(16))
  with pytest.raises(CorruptCheckpointError, match="past its end"):
    ckpt.load_safetensors(f"{s3_bucket}/bad/m.safetensors", target=None)
