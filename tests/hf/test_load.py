"""ckpt.load_safetensors on one process (8 CPU devices): sources, names,
stacking and transposing, placement on a mesh, what is read, errors."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors.numpy import save_file

import ckpt
from ckpt.errors import CorruptCheckpointError, TreeMismatchError
from ckpt.hf import leaves as leaves_lib
from ckpt.restore import readcount
from ckpt.restore.lazy_derived import LazyStack
from tests.hf import llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  d = tmp_path_factory.mktemp("llama")
  t = llama.tensors()
  llama.write(d, t, shards=2)
  return str(d), t


def mesh() -> Mesh:
  return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def target(dtype=llama.BF16, specs=None):
  """The flax tree as ShapeDtypeStructs on the 2 x 4 mesh."""
  m = mesh()
  out = {}
  for path, v in llama.expected(llama.tensors()).items():
    spec = (specs or {}).get(path)
    if spec is None:  # kernels: last axis over model; the rest replicated
      spec = P(*([None] * (v.ndim - 1)), "model") if v.ndim > 1 else P()
    out[path] = jax.ShapeDtypeStruct(v.shape, dtype,
                                     sharding=NamedSharding(m, spec))
  return llama.nested(out)


def flat(tree) -> dict[str, object]:
  return {"/".join(str(k.key) for k in p): v
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_placed(result, want: dict[str, np.ndarray], tgt) -> None:
  got, tgts = flat(result), flat(tgt)
  assert sorted(got) == sorted(want)
  for path, arr in got.items():
    assert arr.sharding == tgts[path].sharding, path
    assert arr.dtype == tgts[path].dtype, path
    for shard in arr.addressable_shards:
      expect = want[path][shard.index].astype(arr.dtype)
      assert np.array_equal(np.asarray(shard.data), expect), path


@pytest.mark.parametrize("form", ["dir", "dir_no_index", "index", "url"])
def test_every_source_form_reads_every_tensor(model, tmp_path, form):
  d, t = model
  src = {"dir": d, "index": os.path.join(d, "model.safetensors.index.json"),
         "url": f"file://{d}"}.get(form)
  if form == "dir_no_index":
    src = str(tmp_path)
    llama.write(src, t, shards=3, index=False)
  got = ckpt.load_safetensors(src, target=None)
  assert sorted(got) == sorted(t)
  for k, v in t.items():
    assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k


def test_one_file(tmp_path):
  x = np.arange(12, dtype=np.float32).reshape(3, 4)
  save_file({"a/b": x, "c": np.full((), 3, np.int8)},
            str(tmp_path / "m.safetensors"))
  got = ckpt.load_safetensors(str(tmp_path / "m.safetensors"), target=None)
  assert np.array_equal(got["a/b"], x) and got["c"].shape == ()
  tgt = {"a": {"b": jax.ShapeDtypeStruct((3, 4), jnp.float32)},
         "c": jax.ShapeDtypeStruct((), jnp.int8)}
  got = ckpt.load_safetensors(str(tmp_path / "m.safetensors"), target=tgt)
  assert np.array_equal(got["a"]["b"], x) and int(got["c"]) == 3


@pytest.mark.parametrize("dtype", [llama.BF16, np.dtype("float32")])
def test_llama_onto_a_scanned_tree_stacked_transposed_and_cast(model, dtype):
  d, t = model
  tgt = target(dtype)
  out = ckpt.load_safetensors(d, target=tgt, names=llama.NAMES)
  check_placed(out, llama.expected(t), tgt)


def test_names_as_a_dict_and_as_a_function(model):
  d, t = model
  keep = {"model.embed_tokens.weight": "emb",
          "lm_head.weight": "head.T"}
  drop = {k: None for k in t if k not in keep}
  tgt = {"emb": jax.ShapeDtypeStruct((llama.VOCAB, llama.HIDDEN), llama.BF16),
         "head": jax.ShapeDtypeStruct((llama.HIDDEN, llama.VOCAB), llama.BF16)}
  out = ckpt.load_safetensors(d, target=tgt, names={**keep, **drop})
  assert np.array_equal(out["head"], t["lm_head.weight"].T)
  out = ckpt.load_safetensors(d, target=tgt,
                              names=lambda k: {**keep, **drop}[k])
  assert np.array_equal(out["emb"], t["model.embed_tokens.weight"])


def test_transforms_see_lazy_leaves_and_stacks(model):
  d, t = model
  seen = {}

  def peek(tree, target_tree, is_resuming):
    del target_tree, is_resuming
    seen["q"] = tree["params"]["layers"]["attn"]["q"]["kernel"]
    tree["params"]["embedding"] = tree["params"].pop("embed")
    return tree
  tgt = target()
  tgt["params"]["embedding"] = tgt["params"].pop("embed")
  out = ckpt.load_safetensors(d, target=tgt, names=llama.NAMES,
                              transforms=[peek])
  assert isinstance(seen["q"], LazyStack)
  assert all(isinstance(m, leaves_lib.Transposed) for m in seen["q"].members)
  assert np.array_equal(out["params"]["embedding"]["embedding"],
                        t["model.embed_tokens.weight"])


def counting():
  counter = readcount.ReadCounter()
  readcount.COUNTER.set(counter)
  return counter


def test_a_row_block_is_one_ranged_read(tmp_path, monkeypatch):
  # Pieces of at most 1 KiB (or the largest box): each device's rows (a
  # row block of 2 KiB) come in one ranged read, exactly its bytes.
  monkeypatch.setattr(leaves_lib, "PIECE_BYTES", 1 << 10)
  x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  save_file({"w": x}, str(tmp_path / "m.safetensors"))
  tgt = {"w": jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh(), P(("data", "model"))))}
  counter = counting()
  out = ckpt.load_safetensors(str(tmp_path), target=tgt)
  assert np.array_equal(np.asarray(out["w"]), x)
  assert counter.reads == 8
  assert counter.bytes_read == counter.chunk_bytes_read == x.nbytes


def test_columns_read_the_rows_covering_them_once_per_process(
    tmp_path, monkeypatch):
  # 8 boxes of 32 rows x 8 columns: every row is needed by 4 devices, and
  # fetched once (in 8 pieces of 8 rows: 1 KiB, the largest box), never
  # once per device.
  monkeypatch.setattr(leaves_lib, "PIECE_BYTES", 1 << 10)
  x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  save_file({"w": x}, str(tmp_path / "m.safetensors"))
  tgt = {"w": jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh(), P("data", "model")))}
  counter = counting()
  out = ckpt.load_safetensors(str(tmp_path), target=tgt)
  assert np.array_equal(np.asarray(out["w"]), x)
  assert counter.bytes_read == counter.chunk_bytes_read == x.nbytes
  assert counter.reads == 8


def test_the_whole_tensor_in_one_process_is_one_read(tmp_path):
  x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  save_file({"w": x}, str(tmp_path / "m.safetensors"))
  tgt = {"w": jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh(), P("data", "model")))}
  counter = counting()
  ckpt.load_safetensors(str(tmp_path), target=tgt)
  assert counter.reads == 1 and counter.chunk_bytes_read == x.nbytes


def test_host_memory_stays_within_concurrent_bytes(model):
  d, t = model
  counter = counting()
  budget = 4096
  out = ckpt.load_safetensors(d, target=target(), names=llama.NAMES,
                              concurrent_bytes=budget)
  check_placed(out, llama.expected(t), target())
  assert 0 < counter.peak_in_use <= budget


# ---- errors ---------------------------------------------------------------------

def test_missing_and_left_over_are_listed_together(model):
  d, _ = model
  names = [r for r in llama.NAMES if "lm_head" not in r[0]]
  names.insert(0, (r"model\.norm\.weight", "params/final_norm/scale"))
  with pytest.raises(TreeMismatchError) as e:
    ckpt.load_safetensors(d, target=target(), names=names)
  msg = str(e.value)
  assert "missing" in msg and "'params/lm_head/kernel'" in msg
  assert "'params/norm/scale'" in msg
  assert "'params/final_norm/scale' from 'model.norm.weight'" in msg
  assert "(keys no rule of names places): 'lm_head.weight'" in msg


def test_a_shape_mismatch_names_the_key_and_the_path(model):
  d, _ = model
  tgt = target()
  tgt["params"]["lm_head"]["kernel"] = jax.ShapeDtypeStruct(
      (llama.VOCAB, llama.HIDDEN), llama.BF16)
  with pytest.raises(TreeMismatchError,
                     match=r"'params/lm_head/kernel' has shape \(48, 32\); "
                     r"'lm_head.weight' gives \(32, 48\)"):
    ckpt.load_safetensors(d, target=tgt, names=llama.NAMES)


def test_a_stack_with_a_gap_names_the_missing_index(model):
  d, _ = model
  names = [(r"model\.layers\.2\..*", None)] + llama.NAMES
  with pytest.raises(TreeMismatchError, match=r"no key is placed at \[2\]"):
    ckpt.load_safetensors(d, target=target(), names=names)


def test_two_keys_at_one_place_are_refused(model):
  d, _ = model
  names = [(r"model\.(embed_tokens|norm)\.weight", "x")] + llama.NAMES
  with pytest.raises(TreeMismatchError, match="maps both"):
    ckpt.load_safetensors(d, target=target(), names=names)


def test_an_integer_cast_is_refused_naming_the_key(tmp_path):
  save_file({"n": np.arange(4, dtype=np.int32)}, str(tmp_path / "m.safetensors"))
  with pytest.raises(TreeMismatchError, match=r"n \(from 'n'\)"):
    ckpt.load_safetensors(str(tmp_path), target={
        "n": jax.ShapeDtypeStruct((4,), jnp.int8)})


def test_a_key_in_two_files_is_refused(tmp_path):
  save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "a.safetensors"))
  save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "b.safetensors"))
  with pytest.raises(TreeMismatchError, match="'w' is in both"):
    ckpt.load_safetensors(str(tmp_path), target=None)


def test_an_index_naming_a_key_its_file_lacks(model, tmp_path):
  d, t = model
  llama.write(tmp_path, {k: v for k, v in t.items() if k != "lm_head.weight"})
  index = tmp_path / "model.safetensors.index.json"
  text = index.read_text().replace(
      '"model.norm.weight"', '"lm_head.weight": '
      '"model-00001-of-00002.safetensors", "model.norm.weight"')
  index.write_text(text)
  with pytest.raises(CorruptCheckpointError,
                     match="'lm_head.weight' to model-00001"):
    ckpt.load_safetensors(str(tmp_path), target=None)


def test_a_restore_transform_stacks_per_layer_leaves(model):
  # names keeps one leaf per layer; ckpt.transforms.stack_layers stacks them
  # (a LazyStack of the files' transposed tensors), read onto the mesh.
  d, t = model
  names = [(r"model\.layers\.(\d+)\.mlp\.up_proj\.weight",
            r"params/layers_\1/up/kernel.T"), (r".*", None)]
  want = llama.expected(t)["params/layers/mlp/up/kernel"]
  tgt = {"params": {"layers": {"up": {"kernel": jax.ShapeDtypeStruct(
      want.shape, want.dtype,
      sharding=NamedSharding(mesh(), P("data", None, "model")))}}}}
  out = ckpt.load_safetensors(d, target=tgt, names=names,
                              transforms=[ckpt.transforms.stack_layers()])
  got = out["params"]["layers"]["up"]["kernel"]
  assert got.sharding == tgt["params"]["layers"]["up"]["kernel"].sharding
  assert np.array_equal(np.asarray(got), want)
