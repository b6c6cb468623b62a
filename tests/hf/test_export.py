"""ckpt.export_safetensors and ``ckpt export --to safetensors OUT_DIR``: a
saved step as Hub-ready shards + index JSON, opened with the safetensors
library, names reversed, dtypes kept, memory bounded by slices."""

from __future__ import annotations

import json
import os
import tracemalloc

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

import ckpt
from ckpt.cli import main as cli
from ckpt.errors import CheckpointError
from ckpt.hf import export as export_lib
from ckpt.hf import names as names_lib
from tests.hf import llama


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A training state with the scanned llama params (bf16), optimizer state
  and a step counter, saved as step 7."""
  root = str(tmp_path_factory.mktemp("ck"))
  hf = llama.tensors(seed=3)
  params = llama.nested(llama.expected(hf))
  state = {**params, "opt": {"mu": np.zeros((5,), np.float32)}, "step": 7}
  with ckpt.Checkpointer(root, async_save=False) as c:
    c.save(7, state)
  return root, hf, params


def read_set(out_dir) -> tuple[dict, dict[str, np.ndarray]]:
  with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
    index = json.load(f)
  tensors = {}
  for name in sorted(set(index["weight_map"].values())):
    got = load_file(os.path.join(out_dir, name))
    assert not set(got) & set(tensors)
    tensors.update(got)
    with safe_open(os.path.join(out_dir, name), "numpy") as f:
      assert f.metadata() == {"format": "pt"}
  return index, tensors


def test_a_hub_ready_set_with_names_reversed(saved, tmp_path):
  root, hf, _ = saved
  out = str(tmp_path / "out")
  limit = 12 << 10
  report = ckpt.export_safetensors(root, out, names=llama.NAMES,
                                   max_shard_bytes=limit)
  index, tensors = read_set(out)
  assert sorted(tensors) == sorted(hf)
  for k, v in hf.items():
    assert tensors[k].dtype == llama.BF16, k  # bf16 stays BF16
    assert np.array_equal(tensors[k], v), k
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in hf.values())
  assert set(index["weight_map"]) == set(hf)
  assert len(report.files) > 2 and report.files == sorted(
      set(index["weight_map"].values()))
  for name in report.files:  # each shard's data within the limit
    with safe_open(os.path.join(out, name), "numpy") as f:
      size = sum(f.get_slice(k).get_shape() and f.get_tensor(k).nbytes
                 for k in f.keys())
    assert size <= limit, name
  assert report.skipped == ["opt/mu", "step"]
  assert report.step == 7 and report.tensors == len(hf)


def test_the_set_loads_back_onto_the_target(saved, tmp_path):
  root, _, params = saved
  out = str(tmp_path / "out")
  ckpt.export_safetensors(root, out, names=llama.NAMES, max_shard_bytes=1 << 14)
  tgt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  back = ckpt.load_safetensors(out, target=tgt, names=llama.NAMES)
  for (p, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(back)[0],
                            jax.tree_util.tree_flatten_with_path(params)[0]):
    assert np.array_equal(a, b), p


def test_without_names_keys_are_leaf_paths(saved, tmp_path):
  root, _, params = saved
  out = str(tmp_path / "out")
  report = ckpt.export_safetensors(root, out)
  _, tensors = read_set(out)
  assert sorted(tensors) == sorted(
      list(llama.expected(llama.tensors())) + ["opt/mu"])
  assert np.array_equal(tensors["params/layers/attn/q/kernel"],
                        params["params"]["layers"]["attn"]["q"]["kernel"])
  assert report.skipped == ["step"] and len(report.files) == 1


def test_names_with_a_dict_reverse(saved, tmp_path):
  root, hf, _ = saved
  names = {"model.norm.weight": "params/norm/scale",
           "model.embed_tokens.weight": "params/embed/embedding",
           "drop.me": None}
  ckpt.export_safetensors(root, str(tmp_path / "o"), names=names)
  _, tensors = read_set(str(tmp_path / "o"))
  assert sorted(tensors) == ["model.embed_tokens.weight", "model.norm.weight"]
  assert np.array_equal(tensors["model.norm.weight"], hf["model.norm.weight"])


@pytest.mark.parametrize("names,match", [
    (lambda k: k, "a function"),
    ([(r"model\.layers\.\d+\.x", r"params/layers/attn/q/kernel")],
     r"'\\\\d' outside a group"),
    ([(r"model\.(a|b)\.(\d+)", r"params/\2")], r"does not use group\(s\) \[1\]"),
    ({"a": "params/norm/scale", "b": "params/norm/scale"}, "maps both"),
    ([(r"model\.layers\.(\d+)\.q", r"params/layers/attn/q/kernel[\1].T"),
      (r"model\.q(\d+)", r"params/layers/attn/q/kernel[\1].T")],
     None),
])
def test_names_export_cannot_reverse_are_refused(saved, tmp_path, names,
                                                 match):
  root, _, _ = saved
  if match is None:  # two rules that both reverse: the first one wins
    ckpt.export_safetensors(root, str(tmp_path / "o"), names=names)
    _, tensors = read_set(str(tmp_path / "o"))
    assert sorted(tensors) == [f"model.layers.{i}.q"
                               for i in range(llama.LAYERS)]
    return
  with pytest.raises(names_lib.NotReversible, match=match):
    ckpt.export_safetensors(root, str(tmp_path / "o"), names=names)
  assert not os.path.exists(tmp_path / "o" / "model.safetensors.index.json")


def test_an_existing_set_is_never_overwritten(saved, tmp_path):
  root, _, _ = saved
  out = tmp_path / "o"
  ckpt.export_safetensors(root, str(out))
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  with pytest.raises(CheckpointError, match="already holds"):
    ckpt.export_safetensors(root, str(out))
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_memory_holds_slices_not_leaves(tmp_path, monkeypatch):
  # One stacked leaf of 8 MiB written as 4 transposed tensors of 2 MiB, in
  # slices of 64 KiB: the export never holds a tensor, let alone the leaf.
  root = str(tmp_path / "ck")
  rng = np.random.default_rng(0)
  big = rng.standard_normal((4, 1024, 512), np.float32).astype(llama.BF16)
  with ckpt.Checkpointer(root, async_save=False) as c:
    c.save(1, {"layers": {"w": big}})
  monkeypatch.setattr(export_lib, "SLICE_BYTES", 64 << 10)
  tracemalloc.start()
  try:
    ckpt.export_safetensors(root, str(tmp_path / "o"),
                            names=[(r"l\.(\d+)\.w", r"layers/w[\1].T")])
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 1 << 20, peak
  _, tensors = read_set(str(tmp_path / "o"))
  for i in range(4):
    assert np.array_equal(tensors[f"l.{i}.w"], big[i].T)


def test_cli_export_to_a_directory(saved, tmp_path, capsys):
  root, hf, _ = saved
  rules = tmp_path / "names.json"
  rules.write_text(json.dumps([list(r) for r in llama.NAMES]))
  out = tmp_path / "out"
  rc = cli.main(["export", root, str(out), "--to", "safetensors",
                 "--max-shard-size", "16K", "--names", str(rules), "--json"])
  assert rc == 0
  report = json.loads(capsys.readouterr().out)
  assert report["tensors"] == len(hf) and report["skipped"] == ["opt/mu",
                                                                "step"]
  _, tensors = read_set(str(out))
  assert sorted(tensors) == sorted(hf)
  # A file name ending in .safetensors is still the one-file export.
  rc = cli.main(["export", root, str(tmp_path / "one.safetensors")])
  assert rc == 0 and sorted(load_file(str(tmp_path / "one.safetensors"))) == (
      sorted(list(llama.expected(hf)) + ["opt/mu"]))
