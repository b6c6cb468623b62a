"""Restore into a changed model: transforms, fallback, partial and lazy restore.

One process with 8 CPU devices, real TensorStore arrays on the local disk.
The helpers of ``ckpt.transforms`` are first tested on hand-built trees of
in-memory lazy leaves (no I/O), then end to end through
``Checkpointer.restore``. "Data is read only for leaves that end up in the
result" is proven the hard way: the arrays of every leaf a restore does not
want are deleted from a copy of the checkpoint, and the restore must still
succeed bit for bit (while deleting a wanted one must fail, naming it).
"""

import asyncio
import pathlib
import re
import shutil
import threading

import jax
import ml_dtypes
import numpy as np
import pytest

import ckpt
from ckpt.restore import lazy
from ckpt.restore import lazy_derived
from ckpt.restore import transforms as T
from ckpt.format import tree
from ckpt.shards import plan
from tests.conftest import (AdamState, TrainState, mesh, named, random_array,
                            sharded)


@pytest.fixture(scope="module", autouse=True)
def _arrays_only(arrays_only):
  """Small test arrays stay TensorStore arrays (tests/save/test_pack.py covers
  packed leaves)."""
  del arrays_only


BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
LAYERS = 4
PRETRAINED_STEP = 100


# ---- helpers ----------------------------------------------------------------

def lv(rng, shape, path, dtype=np.float32):
  """An in-memory lazy leaf holding random data."""
  return lazy.LazyValue(random_array(rng, shape, dtype), path)


def flat(nested) -> dict:
  """Nested dicts -> {"a/b/c": leaf}."""
  return {tree.path_str(p): v for p, v in tree.unnest(nested).items()}


def value(leaf) -> np.ndarray:
  """The data of a lazy leaf, read on the host."""
  assert isinstance(leaf, ckpt.LazyLeaf), type(leaf)
  return np.asarray(leaf.read())


def same_bits(got, want) -> bool:
  got, want = np.asarray(got), np.asarray(want)
  return (got.dtype == want.dtype and got.shape == want.shape and
          np.ascontiguousarray(got).tobytes() ==
          np.ascontiguousarray(want).tobytes())


def assert_placed(x, want: np.ndarray, sharding=None) -> None:
  """``x`` is a jax.Array with ``want``'s bits in every addressable shard."""
  assert isinstance(x, jax.Array), type(x)
  assert (x.shape, x.dtype) == (want.shape, want.dtype), (
      f"got {x.shape} {x.dtype}, want {want.shape} {want.dtype}")
  if sharding is not None:
    assert x.sharding.is_equivalent_to(sharding, x.ndim), (
        f"sharding {x.sharding} is not {sharding}")
  assert len(x.addressable_shards) == len(x.sharding.device_set)
  for s in x.addressable_shards:
    assert same_bits(s.data, want[s.index]), f"shard {s.index} on {s.device}"


def tree_get(t, parts):
  for p in parts:
    t = t[p]
  return t


def sds(m, shape, *spec, dtype=np.float32):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=named(m, *spec))


def step_dir(root, step=PRETRAINED_STEP):
  return root / f"checkpoint_{step}"


def remove_array(root, leaf: str, step=PRETRAINED_STEP) -> None:
  """Deletes the stored array (or subtree of arrays) of ``leaf``."""
  where = step_dir(root, step) / leaf
  assert where.is_dir(), f"{where} is not in the checkpoint"
  assert list(where.rglob(".zarray")), f"{where} holds no array"
  shutil.rmtree(where)


# ---- the pretrained checkpoint: per-layer params, optimizer state -----------

def pretrained_state(rng, m):
  def layer():
    return {"attn": {"w": sharded(random_array(rng, (32, 32)),
                                  named(m, "data", "model"))},
            "mlp": {"w": sharded(random_array(rng, (32, 64)),
                                 named(m, None, "model")),
                    "b": random_array(rng, (96,))}}  # host numpy, 384 bytes

  params = {"embed": {"table": sharded(random_array(rng, (64, 32)),
                                       named(m, "model", None))},
            **{f"layers_{i}": layer() for i in range(LAYERS)},
            "head": {"w": random_array(rng, (32, 16))}}
  mu = jax.tree.map(lambda x: random_array(rng, x.shape), params)
  return {"params": params, "opt": {"mu": mu, "count": np.int32(7)},
          "step": PRETRAINED_STEP, "name": "pretrained"}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """(checkpoint root with step 100, {leaf path: numpy truth})."""
  root = tmp_path_factory.mktemp("pretrained") / "ckpts"
  state = pretrained_state(np.random.default_rng(4), mesh())
  with ckpt.Checkpointer(root, async_save=False) as ckptr:
    ckptr.save(PRETRAINED_STEP, state)
  truth = {tree.path_str(p): (np.asarray(x) if hasattr(x, "shape") else x)
           for p, x in tree.flatten(state)}
  return root, truth


@pytest.fixture
def pretrained_copy(pretrained, tmp_path):
  """A private copy of the pretrained checkpoint (safe to damage)."""
  root, truth = pretrained
  dst = tmp_path / "copy"
  shutil.copytree(root, dst)
  return dst, truth


def stacked(truth, leaf: str, axis: int = 0) -> np.ndarray:
  return np.stack([truth[f"params/layers_{i}/{leaf}"] for i in range(LAYERS)],
                  axis=axis)


# Today's model: "embed" became "embedding", the layers are stacked for
# scan, and there is a new "norm" the checkpoint does not have.
NEW_MODEL_TRANSFORMS = (T.rename(r"params/embed/(.*)", r"params/embedding/\1"),
                        T.stack_layers(r"layers_(\d+)", "layers"))


def new_model_target(m, dtype=np.float32):
  return {"params": {
      "embedding": {"table": sds(m, (64, 32), None, "model", dtype=dtype)},
      "layers": {"attn": {"w": sds(m, (LAYERS, 32, 32), "data", None, "model",
                                   dtype=dtype)},
                 "mlp": {"w": sds(m, (LAYERS, 32, 64), None, "model", None,
                                  dtype=dtype),
                         "b": sds(m, (LAYERS, 96), "model", "data",
                                  dtype=dtype)}},
      "norm": {"scale": sds(m, (32,), "model", dtype=dtype)}},
      "step": 0}


def norm_fallback(m):
  scale = np.linspace(0.5, 1.5, 32, dtype=np.float32)
  return scale, {"params": {"norm": {"scale": sharded(scale, named(m))}}}


def expected_new_model(truth, scale) -> dict[str, np.ndarray]:
  return {"params/embedding/table": truth["params/embed/table"],
          "params/layers/attn/w": stacked(truth, "attn/w"),
          "params/layers/mlp/w": stacked(truth, "mlp/w"),
          "params/layers/mlp/b": stacked(truth, "mlp/b"),
          "params/norm/scale": scale}


def assert_new_model(restored, target, truth, scale) -> None:
  assert jax.tree.structure(restored) == jax.tree.structure(target)
  got = dict((tree.path_str(p), x) for p, x in tree.flatten(restored))
  want = expected_new_model(truth, scale)
  for parts, t in tree.flatten(target):
    name = tree.path_str(parts)
    if name == "step":
      assert got[name] == PRETRAINED_STEP
      continue
    assert_placed(got[name], want[name].astype(t.dtype), t.sharding)


# ---- rename -----------------------------------------------------------------

def test_rename_moves_matching_leaves_without_reading_them(rng):
  t = {"params": {"enc": {"w": lv(rng, (4, 3), "params/enc/w"),
                          "b": lv(rng, (3,), "params/enc/b")},
                  "dec": {"w": lv(rng, (3, 4), "params/dec/w")}},
       "step": 5}
  out = T.rename(r"params/(\w+)/w", r"params/\1/kernel")(t, None,
                                                         is_resuming=False)
  before, after = flat(t), flat(out)
  assert set(after) == {"params/enc/kernel", "params/enc/b",
                        "params/dec/kernel", "step"}
  # The very same lazy objects, moved: nothing was read or copied.
  assert after["params/enc/kernel"] is before["params/enc/w"]
  assert after["params/dec/kernel"] is before["params/dec/w"]
  assert after["params/enc/b"] is before["params/enc/b"]
  assert after["step"] == 5
  assert isinstance(out["params"]["enc"], dict)  # nested again


def test_rename_can_move_a_leaf_to_another_subtree(rng):
  t = {"encoder": {"embed": lv(rng, (8, 2), "encoder/embed")},
       "decoder": {"w": lv(rng, (2, 2), "decoder/w")}}
  out = T.rename("encoder/embed", "shared/embedding")(t)
  assert set(flat(out)) == {"shared/embedding", "decoder/w"}
  assert "encoder" not in out  # emptied subtrees disappear


def test_rename_two_leaves_onto_one_path_names_both(rng):
  t = {"params": {"enc": {"w": lv(rng, (2,), "a")},
                  "dec": {"w": lv(rng, (2,), "b")}}}
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.rename(r"params/(enc|dec)/w", r"params/w")(t)
  msg = str(e.value)
  assert "'params/enc/w'" in msg and "'params/dec/w'" in msg
  assert "'params/w'" in msg


def test_rename_onto_an_existing_leaf_names_both(rng):
  t = {"params": {"w": lv(rng, (2,), "a"), "kernel": lv(rng, (2,), "b")}}
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.rename("params/w", "params/kernel")(t)
  assert "'params/w'" in str(e.value) and "'params/kernel'" in str(e.value)


@pytest.mark.parametrize("pattern, replacement", [
    ("a/c", "b"),   # a leaf moves onto the subtree b/ (b/d is silently lost)
    ("x", "b/d/e"),  # a leaf moves under the leaf b/d (a bare TypeError)
])
def test_rename_onto_a_subtree_or_under_a_leaf_names_both(rng, pattern,
                                                          replacement):
  t = {"a": {"c": lv(rng, (2,), "a/c")}, "b": {"d": lv(rng, (2,), "b/d")},
       "x": lv(rng, (2,), "x")}
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.rename(pattern, replacement)(t)
  assert "'b/d'" in str(e.value)


def test_rename_pattern_matching_nothing_lists_the_leaves(rng):
  t = {"params": {"w": lv(rng, (2,), "params/w")}, "step": 1}
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.rename(r"parms/(.*)", r"params/\1")(t)
  msg = str(e.value)
  assert "'parms/(.*)'" in msg and "params/w" in msg and "step" in msg
  # Patterns match the whole path: a substring is not a match.
  with pytest.raises(ckpt.TreeMismatchError, match="matches no checkpoint"):
    T.rename("w", "kernel")(t)
  out = T.rename(r"parms/(.*)", r"params/\1", strict=False)(t)
  assert flat(out) == flat(t)


# ---- drop -------------------------------------------------------------------

def test_drop_removes_matching_leaves(rng):
  t = {"params": {"w": lv(rng, (3,), "params/w")},
       "opt": {"mu": {"w": lv(rng, (3,), "opt/mu/w")},
               "nu": {"w": lv(rng, (3,), "opt/nu/w")}, "count": 3},
       "step": 7}
  out = T.drop(r"opt/.*")(t)
  assert set(flat(out)) == {"params/w", "step"}
  assert flat(out)["params/w"] is t["params"]["w"]
  assert "opt" not in out
  # Full match: "opt/mu" is a subtree, not a leaf, so it matches nothing.
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.drop("opt/mu")(t)
  assert "'opt/mu'" in str(e.value) and "opt/mu/w" in str(e.value)
  assert flat(T.drop("opt/mu", strict=False)(t)) == flat(t)
  assert T.drop(".*")(t) == {}


# ---- assignment_map ---------------------------------------------------------

def _assignment_fixture(rng):
  ckpt_tree = {"params": {"encoder": {"w": lv(rng, (4, 4), "params/encoder/w")},
                          "decoder": {"w": lv(rng, (4, 4), "params/decoder/w")},
                          "head": {"w": lv(rng, (4, 2), "params/head/w")}},
               "old": {"thing": lv(rng, (5,), "old/thing")}}
  f = jax.ShapeDtypeStruct
  target = {"params": {"enc": {"kernel": f((4, 4), F32)},
                       "dec": {"kernel": f((4, 4), F32)},
                       "head": {"w": f((4, 2), F32)},
                       "norm": {"scale": f((4,), F32)}}}
  return ckpt_tree, target


def test_assignment_map_pulls_target_leaves_from_checkpoint_paths(rng):
  ckpt_tree, target = _assignment_fixture(rng)
  fn = T.assignment_map([
      (r"params/(enc|dec)/kernel", r"params/\1oder/w"),
      (r"params/norm/.*", None),      # not restored: the fallback gives it
  ])
  out = flat(fn(ckpt_tree, target, is_resuming=False))
  src = flat(ckpt_tree)
  # Only target leaves are left, so nothing else is ever read.
  assert set(out) == {"params/enc/kernel", "params/dec/kernel",
                      "params/head/w"}
  assert out["params/enc/kernel"] is src["params/encoder/w"]
  assert out["params/dec/kernel"] is src["params/decoder/w"]
  assert out["params/head/w"] is src["params/head/w"]  # no rule: same path


def test_assignment_map_none_entry_excludes_a_leaf_the_checkpoint_has(rng):
  ckpt_tree, target = _assignment_fixture(rng)
  fn = T.assignment_map([(r"params/head/.*", None),
                         (r"params/(enc|dec)/kernel", r"params/\1oder/w")])
  out = flat(fn(ckpt_tree, target))
  assert "params/head/w" not in out
  assert set(out) == {"params/enc/kernel", "params/dec/kernel"}


def test_assignment_map_first_matching_rule_wins(rng):
  ckpt_tree, target = _assignment_fixture(rng)
  fn = T.assignment_map([(r"params/enc/kernel", r"params/decoder/w"),
                         (r"params/(\w+)/kernel", r"params/\1oder/w")])
  out, src = flat(fn(ckpt_tree, target)), flat(ckpt_tree)
  assert out["params/enc/kernel"] is src["params/decoder/w"]
  assert out["params/dec/kernel"] is src["params/decoder/w"]


def test_assignment_map_missing_sources_are_all_named(rng):
  ckpt_tree, target = _assignment_fixture(rng)
  fn = T.assignment_map([(r"params/(enc|dec)/kernel", r"params/\1/w")])
  with pytest.raises(ckpt.TreeMismatchError) as e:
    fn(ckpt_tree, target)
  msg = str(e.value)
  assert "params/enc/kernel <- params/enc/w" in msg
  assert "params/dec/kernel <- params/dec/w" in msg


def test_assignment_map_unused_patterns_are_all_named(rng):
  ckpt_tree, target = _assignment_fixture(rng)
  fn = T.assignment_map([(r"params/(enc|dec)/kernel", r"params/\1oder/w"),
                         (r"params/encoder/.*", None),
                         (r"model/.*", r"params/\0")])
  with pytest.raises(ckpt.TreeMismatchError) as e:
    fn(ckpt_tree, target)
  msg = str(e.value)
  assert "params/encoder/.*" in msg and "model/.*" in msg
  assert "(enc|dec)" not in msg


def test_assignment_map_needs_a_target(rng):
  ckpt_tree, _ = _assignment_fixture(rng)
  with pytest.raises(ckpt.TreeMismatchError, match="needs a restore target"):
    T.assignment_map([("a", "b")])(ckpt_tree, None)


# ---- stack_layers / unstack_layers ------------------------------------------

def _layered(rng, n=LAYERS, shape=(3, 5), prefix="enc", skip=(), bias=True,
             **special):
  """{prefix: {layers_i: {w, b}}} plus an unrelated leaf."""
  layers = {}
  for i in range(n):
    if i in skip:
      continue
    name = f"layers_{i}"
    w = special.get(name, lv(rng, shape, f"{prefix}/{name}/w"))
    layers[name] = {"w": w}
    if bias:
      layers[name]["b"] = lv(rng, shape[-1:], f"{prefix}/{name}/b")
  return {prefix: layers, "embed": lv(rng, (7, 3), "embed")}


def test_stack_layers_stacks_in_numeric_layer_order(rng):
  t = _layered(rng, n=12)  # layers_10 sorts before layers_2 as a string
  out = T.stack_layers()(t)
  src = flat(t)
  assert set(flat(out)) == {"enc/layers/w", "enc/layers/b", "embed"}
  w, b = out["enc"]["layers"]["w"], out["enc"]["layers"]["b"]
  assert isinstance(w, ckpt.LazyLeaf) and isinstance(b, ckpt.LazyLeaf)
  assert (w.shape, w.dtype, b.shape) == ((12, 3, 5), F32, (12, 5))
  assert out["embed"] is t["embed"]
  want = np.stack([value(src[f"enc/layers_{i}/w"]) for i in range(12)])
  assert same_bits(value(w), want)
  assert same_bits(value(b), np.stack([value(src[f"enc/layers_{i}/b"])
                                       for i in range(12)]))


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_stack_layers_on_any_axis_and_unstack_round_trip(rng, axis):
  t = _layered(rng, bias=False)
  src = flat(t)
  out = T.stack_layers(axis=axis)(t)
  w = out["enc"]["layers"]["w"]
  want = np.stack([value(src[f"enc/layers_{i}/w"]) for i in range(LAYERS)],
                  axis=axis)
  assert w.shape == want.shape
  assert same_bits(value(w), want)
  # A box that cuts the stacked axis and the others reads just that part.
  box = plan.Box(tuple(1 for _ in want.shape), want.shape)
  got = asyncio.run(w.read_box(box))
  assert same_bits(got, want[box.slices()])
  back = T.unstack_layers(axis=axis)(out)
  assert set(flat(back)) == set(src)
  for name, leaf in flat(back).items():
    assert same_bits(value(leaf), value(src[name])), name


def test_stack_layers_axis_out_of_range_names_the_stack(rng):
  t = _layered(rng)
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.stack_layers(axis=3)(t)
  assert "enc/layers/" in str(e.value) and "axis 3" in str(e.value)


@pytest.mark.parametrize("skip, layers", [((2,), "[0, 1, 3]"),
                                          ((0,), "[1, 2, 3]")])
def test_stack_layers_gap_in_layer_numbers_names_the_leaf(rng, skip, layers):
  t = _layered(rng, skip=skip)
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.stack_layers()(t)
  msg = str(e.value)
  assert "'enc/layers/" in msg and layers in msg


def test_stack_layers_shape_mismatch_names_both_layers(rng):
  t = _layered(rng, layers_2=lv(rng, (3, 6), "enc/layers_2/w"))
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.stack_layers()(t)
  msg = str(e.value)
  assert "'enc/layers_2/w'" in msg and "'enc/layers_0/w'" in msg
  assert "(3, 6)" in msg and "(3, 5)" in msg


def test_stack_layers_dtype_mismatch_names_both_layers(rng):
  t = _layered(rng, layers_1=lv(rng, (3, 5), "enc/layers_1/w", BF16))
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.stack_layers()(t)
  msg = str(e.value)
  assert "'enc/layers_1/w'" in msg and "'enc/layers_0/w'" in msg
  assert "bfloat16" in msg


def test_stack_layers_onto_an_existing_leaf_names_it(rng):
  t = _layered(rng)
  t["enc"]["layers"] = {"w": lv(rng, (LAYERS, 3, 5), "enc/layers/w")}
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.stack_layers()(t)
  msg = str(e.value)
  assert "'enc/layers/w'" in msg and "enc/layers_0/w" in msg


def test_stack_layers_of_a_non_array_names_it(rng):
  t = _layered(rng, layers_1="not an array")
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.stack_layers()(t)
  assert "'enc/layers_1/w'" in str(e.value) and "str" in str(e.value)


def test_stack_layers_custom_pattern_and_name(rng):
  t = {"blocks": {f"block{i}": {"w": lv(rng, (2, 2), f"blocks/block{i}/w")}
                  for i in range(3)}}
  out = T.stack_layers(r"block(\d+)", "scanned")(t)
  assert set(flat(out)) == {"blocks/scanned/w"}
  assert out["blocks"]["scanned"]["w"].shape == (3, 2, 2)
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.stack_layers()(t)  # the default pattern layers_(\d+) matches nothing
  assert "layers_" in str(e.value) and "blocks/block0/w" in str(e.value)
  assert flat(T.stack_layers(strict=False)(t)) == flat(t)


def test_unstack_layers_gives_lazy_slices(rng):
  data = random_array(rng, (3, 4, 5))
  t = {"dec": {"layers": {"w": lazy.LazyValue(data, "dec/layers/w")}},
       "step": 2}
  out = T.unstack_layers("layers", "block_{}", axis=1)(t)
  assert set(flat(out)) == {"dec/block_0/w", "dec/block_1/w", "dec/block_2/w",
                            "dec/block_3/w", "step"}
  for k in range(4):
    leaf = out["dec"][f"block_{k}"]["w"]
    assert leaf.shape == (3, 5)
    assert same_bits(value(leaf), data[:, k])


def test_unstack_layers_errors_name_the_leaf(rng):
  t = {"layers": {"w": lv(rng, (2, 3), "layers/w"), "n": 4}}
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.unstack_layers(axis=2)(t)
  assert "'layers/w'" in str(e.value) and "(2, 3)" in str(e.value)
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.unstack_layers()(t)
  assert "'layers/n'" in str(e.value) and "int" in str(e.value)
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.unstack_layers("scan")(t)
  assert "'scan'" in str(e.value) and "layers/w" in str(e.value)


@pytest.mark.parametrize("existing_listed_first", [
    False,  # the checkpoint's own (sorted) order: "layers" < "layers_0"
    True,  # an earlier transform put the existing leaf first
])
def test_unstack_layers_onto_an_existing_leaf_names_it(rng,
                                                       existing_listed_first):
  stack = ("layers", {"w": lv(rng, (2, 3), "layers/w")})
  existing = ("layers_0", {"w": lv(rng, (3,), "layers_0/w")})
  # Dict order is whatever earlier transforms produced; both must fail.
  t = dict([existing, stack] if existing_listed_first else [stack, existing])
  with pytest.raises(ckpt.TreeMismatchError) as e:
    T.unstack_layers()(t)
  assert "'layers_0/w'" in str(e.value) and "'layers/w'" in str(e.value)


def test_unstack_layers_never_drops_an_existing_leaf_in_restore(make_ckptr,
                                                                 rng):
  # The same bug seen from restore: an earlier transform reordered the tree.
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, {"layers": {"w": random_array(rng, (2, 16))},
                 "layers_0": {"w": random_array(rng, (16,))}})

  def reorder(ckpt_tree, target_tree, *, is_resuming):
    del target_tree, is_resuming
    return {"layers_0": ckpt_tree["layers_0"], "layers": ckpt_tree["layers"]}

  with pytest.raises(ckpt.TreeMismatchError, match="'layers_0/w'"):
    ckptr.restore(transforms=[reorder, T.unstack_layers()])


# ---- restore through transforms: lazy leaves, only wanted data read ---------

def test_transforms_see_lazy_leaves_and_the_target(pretrained, make_ckptr,
                                                   mesh8):
  root, truth = pretrained
  seen = []

  def record(ckpt_tree, target_tree, *, is_resuming):
    seen.append((ckpt_tree, target_tree, is_resuming))
    return ckpt_tree

  target = new_model_target(mesh8)
  out = make_ckptr(root).restore(
      target=target, transforms=[record, *NEW_MODEL_TRANSFORMS, record],
      fallback_state=norm_fallback(mesh8)[1])
  assert len(seen) == 2
  (first, target_tree, resuming), (last, _, _) = seen
  assert resuming is True  # the Checkpointer's own latest step
  leaves = flat(first)
  assert set(leaves) == set(truth)
  for name, want in truth.items():
    if isinstance(want, np.ndarray):  # stored arrays and inline ones alike
      assert isinstance(leaves[name], ckpt.LazyLeaf), name
      assert leaves[name].shape == want.shape, name
      assert leaves[name].dtype == want.dtype, name
    else:
      assert leaves[name] == want and not isinstance(leaves[name],
                                                     ckpt.LazyLeaf)
  # The target, as nested dicts keyed by path parts.
  assert flat(target_tree) == dict(
      (tree.path_str(p), x) for p, x in tree.flatten(target))
  # After the helpers: stacked and renamed, still lazy.
  after = flat(last)
  assert after["params/layers/attn/w"].shape == (LAYERS, 32, 32)
  assert isinstance(after["params/layers/attn/w"], ckpt.LazyLeaf)
  assert "params/embedding/table" in after and "params/embed/table" not in after
  assert_new_model(out, target, truth, norm_fallback(mesh8)[0])


def test_restore_with_rename_stack_and_fallback_is_bit_exact(
    pretrained, make_ckptr, mesh8):
  root, truth = pretrained
  scale, fallback = norm_fallback(mesh8)
  target = new_model_target(mesh8)
  out = make_ckptr(root).restore(target=target,
                                 transforms=NEW_MODEL_TRANSFORMS,
                                 fallback_state=fallback)
  assert_new_model(out, target, truth, scale)


def test_arrays_the_restore_does_not_want_are_never_read(pretrained_copy,
                                                         make_ckptr, mesh8):
  root, truth = pretrained_copy
  # Not in the new model: the optimizer state and the old head. Delete
  # their arrays; a restore that touched them would fail.
  remove_array(root, "opt")
  remove_array(root, "params/head")
  scale, fallback = norm_fallback(mesh8)
  target = new_model_target(mesh8)
  ckptr = make_ckptr(root)
  out = ckptr.restore(target=target, transforms=NEW_MODEL_TRANSFORMS,
                      fallback_state=fallback)
  assert_new_model(out, target, truth, scale)
  # Without a target, dropping them is what keeps them unread.
  host = ckptr.restore(transforms=[T.drop(r"opt/mu/.*"),
                                   T.drop(r"params/head/.*")])
  got = flat(host)
  assert set(got) == {n for n in truth
                      if not n.startswith(("opt/mu/", "params/head/"))}
  for name, want in truth.items():
    if name in got and isinstance(want, np.ndarray):
      assert same_bits(got[name], want), name
  # Sanity: the deleted arrays are really gone.
  with pytest.raises(ckpt.CorruptCheckpointError,
                     match=r"leaf '(opt/mu|params/head)/"):
    ckptr.restore()


def test_verify_checks_the_arrays_behind_stacked_leaves(pretrained_copy,
                                                        make_ckptr, mesh8):
  root, truth = pretrained_copy
  scale, fallback = norm_fallback(mesh8)
  target = new_model_target(mesh8)
  ckptr = make_ckptr(root)
  out = ckptr.restore(target=target, transforms=NEW_MODEL_TRANSFORMS,
                      fallback_state=fallback, verify=True)
  assert_new_model(out, target, truth, scale)
  # One flipped byte in a chunk of one layer: the stacked leaf names it.
  chunks = [f for f in (step_dir(root) / "params/layers_2/attn/w").iterdir()
            if not f.name.startswith(".")]
  data = bytearray(chunks[0].read_bytes())
  data[5] ^= 0x10
  chunks[0].write_bytes(bytes(data))
  with pytest.raises(ckpt.CorruptCheckpointError,
                     match="'params/layers_2/attn/w'.*crc32c"):
    ckptr.restore(target=target, transforms=NEW_MODEL_TRANSFORMS,
                  fallback_state=fallback, verify=True)


@pytest.mark.parametrize("leaf", ["params/layers_1/mlp/b", "params/embed/table",
                                  "params/layers_3/attn/w"])
def test_deleting_a_wanted_array_fails_naming_it(pretrained_copy, make_ckptr,
                                                 mesh8, leaf):
  root, _ = pretrained_copy
  remove_array(root, leaf)
  with pytest.raises(ckpt.CorruptCheckpointError) as e:
    make_ckptr(root).restore(target=new_model_target(mesh8),
                             transforms=NEW_MODEL_TRANSFORMS,
                             fallback_state=norm_fallback(mesh8)[1])
  assert f"'{leaf}'" in str(e.value)


def test_partial_restore_reads_only_the_subset(pretrained_copy, make_ckptr,
                                               mesh8):
  root, truth = pretrained_copy
  for leaf in ("opt", "params/head", *(f"params/layers_{i}"
                                       for i in range(LAYERS))):
    remove_array(root, leaf)
  # The only array left on disk is params/embed/table.
  target = {"params": {"embed": {"table": sds(mesh8, (64, 32), "data")}},
            "opt": {"count": np.int32(0)}, "name": ""}
  out = make_ckptr(root).restore(target=target)
  assert jax.tree.structure(out) == jax.tree.structure(target)
  assert_placed(out["params"]["embed"]["table"], truth["params/embed/table"],
                named(mesh8, "data"))
  assert out["opt"]["count"] == 7 and out["name"] == "pretrained"


def test_partial_restore_of_a_custom_node(make_ckptr, ckpt_dir, rng, mesh8):
  w = random_array(rng, (64, 32))
  state = TrainState(params={"w": sharded(w, named(mesh8, "data", "model"))},
                     opt_state=AdamState(np.int32(3), {"w": w + 1},
                                         {"w": w + 2}),
                     step=np.int32(9))
  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, state)
  remove_array(ckpt_dir, "opt_state", step=1)
  target = TrainState(params={"w": sds(mesh8, (64, 32), "model")},
                      opt_state=None, step=np.int32(0))
  out = ckptr.restore(target=target)
  assert isinstance(out, TrainState) and out.opt_state is None
  assert_placed(out.params["w"], w, named(mesh8, "model"))
  assert out.step == 9


def test_a_user_transform_can_add_reshape_and_chain(pretrained, make_ckptr,
                                                    mesh8):
  root, truth = pretrained
  added = np.arange(40, dtype=np.float32).reshape(5, 8)
  order = []

  def add_and_reshape(ckpt_tree, target_tree, *, is_resuming):
    del target_tree, is_resuming
    order.append("first")
    t = dict(ckpt_tree)
    t["extra"] = added                                # a plain numpy array
    table = ckpt_tree["params"]["embed"]["table"]
    t["flat_table"] = lazy_derived.LazyReshape(table, (64 * 32,), path="flat_table")
    return t

  def second(ckpt_tree, target_tree, *, is_resuming):
    order.append("second")
    assert "extra" in ckpt_tree  # sees the first transform's output
    return T.rename("extra", "more/extra")(ckpt_tree, target_tree,
                                           is_resuming=is_resuming)

  target = {"more": {"extra": sds(mesh8, (5, 8), None, "model")},
            "flat_table": sds(mesh8, (64 * 32,), "model")}
  out = make_ckptr(root).restore(target=target,
                                 transforms=[add_and_reshape, second])
  assert order == ["first", "second"]
  assert_placed(out["more"]["extra"], added, named(mesh8, None, "model"))
  assert_placed(out["flat_table"], truth["params/embed/table"].reshape(-1),
                named(mesh8, "model"))


def test_shape_mismatch_after_transforms_names_the_leaf(pretrained,
                                                         make_ckptr, mesh8):
  root, _ = pretrained
  target = {"params": {"layers": {"attn": {
      "w": sds(mesh8, (LAYERS + 1, 32, 32), None)}}}}
  with pytest.raises(ckpt.TreeMismatchError) as e:
    make_ckptr(root).restore(target=target, transforms=[T.stack_layers()])
  msg = str(e.value)
  assert "'params/layers/attn/w'" in msg
  assert f"({LAYERS}, 32, 32)" in msg and f"({LAYERS + 1}, 32, 32)" in msg


def test_a_transform_must_return_the_tree(pretrained, make_ckptr):
  root, _ = pretrained

  def forgets_to_return(ckpt_tree, target_tree, *, is_resuming):
    ckpt_tree.pop("opt")

  with pytest.raises(TypeError, match="forgets_to_return.*NoneType"):
    make_ckptr(root).restore(transforms=[forgets_to_return])


class _SlowLeaf(lazy.LazyLeaf):
  """A lazy leaf whose read takes until ``release`` is set (at most 10 s),
  and which notes whether its read finished, was cancelled or still runs."""

  def __init__(self, release: threading.Event):
    self.shape, self.dtype, self.path = (4,), F32, "slow"
    self.release, self.state = release, "not started"

  async def read_box(self, box):
    self.state = "running"
    try:
      for _ in range(1000):
        if self.release.is_set():
          break
        await asyncio.sleep(0.01)
    except asyncio.CancelledError:
      self.state = "cancelled"
      raise
    self.state = "done"
    return np.zeros(box.shape, F32)


class _BrokenLeaf(lazy.LazyLeaf):
  def __init__(self):
    self.shape, self.dtype, self.path = (4,), F32, "broken"

  async def read_box(self, box):
    await asyncio.sleep(0.05)  # the slow read is under way by now
    raise ckpt.CorruptCheckpointError("leaf 'broken': unreadable")


def test_a_failed_restore_leaves_no_read_running(pretrained, make_ckptr):
  root, _ = pretrained
  release = threading.Event()
  slow = _SlowLeaf(release)

  def add(ckpt_tree, target_tree, *, is_resuming):
    del target_tree, is_resuming
    return {"a_slow": slow, "b_broken": _BrokenLeaf()}

  try:
    with pytest.raises(ckpt.CorruptCheckpointError, match="'broken'"):
      make_ckptr(root).restore(transforms=[add])
    state = slow.state
  finally:
    release.set()
  assert state in ("cancelled", "done"), (
      f"restore raised while the read of another leaf was {state!r}")


# ---- is_resuming ------------------------------------------------------------

def _is_resuming_of(ckptr, *args, **kwargs) -> bool:
  flags = []

  def record(ckpt_tree, target_tree, *, is_resuming):
    flags.append(is_resuming)
    return ckpt_tree

  ckptr.restore(*args, transforms=[record], **kwargs)
  assert len(flags) == 1
  return flags[0]


def test_is_resuming_only_for_the_checkpointers_own_latest_step(
    make_ckptr, ckpt_dir, rng):
  ckptr = make_ckptr(async_save=False)
  for step in (1, 2):
    ckptr.save(step, {"w": random_array(rng, (16, 16))})
  assert _is_resuming_of(ckptr) is True            # step=None: the latest
  assert _is_resuming_of(ckptr, 2) is True         # the latest, by number
  assert _is_resuming_of(ckptr, 1) is False        # an earlier step
  # Another job's checkpoint (here the same files) through path=: never.
  assert _is_resuming_of(ckptr, path=str(ckpt_dir)) is False
  assert _is_resuming_of(ckptr, 2, path=str(ckpt_dir)) is False
  assert _is_resuming_of(ckptr, path=str(ckpt_dir / "checkpoint_2")) is False
  ckptr.save(3, {"w": random_array(rng, (16, 16))})
  assert _is_resuming_of(ckptr, 2) is False        # no longer the latest
  # A fresh Checkpointer on the directory (a restarted job) resumes too.
  assert _is_resuming_of(make_ckptr(ckpt_dir)) is True


def test_initialise_from_another_checkpoint_then_resume_with_same_code(
    pretrained, make_ckptr, mesh8, tmp_path):
  root, truth = pretrained
  scale, fallback = norm_fallback(mesh8)
  target = new_model_target(mesh8)

  def when_initialising(fn):
    def wrapped(ckpt_tree, target_tree, *, is_resuming):
      return ckpt_tree if is_resuming else fn(ckpt_tree, target_tree,
                                              is_resuming=is_resuming)
    return wrapped

  transforms = [when_initialising(fn) for fn in NEW_MODEL_TRANSFORMS]

  def start(ckptr):  # what a training job runs at every start
    if ckptr.latest_step() is None:
      return ckptr.restore(path=str(root), target=target,
                           transforms=transforms, fallback_state=fallback)
    return ckptr.restore(target=target, transforms=transforms)

  ckptr = make_ckptr(tmp_path / "finetune", async_save=False)
  state = start(ckptr)
  assert_new_model(state, target, truth, scale)
  ckptr.save(1, state)
  # Resuming: the checkpoint already has today's layout; the helpers (which
  # would find no "embed" and no "layers_<i>" and fail) do not run.
  again = start(make_ckptr(tmp_path / "finetune"))
  assert_new_model(again, target, truth, scale)
  with pytest.raises(ckpt.TreeMismatchError, match="matches no checkpoint"):
    ckptr.restore(target=target, transforms=NEW_MODEL_TRANSFORMS)


# ---- fallback_state and missing leaves --------------------------------------

def test_missing_leaves_error_lists_every_missing_path(pretrained, make_ckptr,
                                                       mesh8):
  root, _ = pretrained
  target = new_model_target(mesh8)
  target["params"]["norm"]["bias"] = sds(mesh8, (32,), None)
  target["extra"] = {"counter": np.int32(0)}
  with pytest.raises(ckpt.MissingLeavesError) as e:
    make_ckptr(root).restore(target=target)  # no transforms, no fallback
  missing = {"params/embedding/table", "params/layers/attn/w",
             "params/layers/mlp/w", "params/layers/mlp/b",
             "params/norm/scale", "params/norm/bias", "extra/counter"}
  assert set(e.value.missing) == missing
  assert isinstance(e.value, ckpt.TreeMismatchError)
  for name in missing:
    assert name in str(e.value)
  assert "params/embed/table" in str(e.value)  # what the checkpoint has
  # After the helpers only the leaves that are new in the model are missing.
  with pytest.raises(ckpt.MissingLeavesError) as e:
    make_ckptr(root).restore(target=target, transforms=NEW_MODEL_TRANSFORMS)
  assert set(e.value.missing) == {"params/norm/scale", "params/norm/bias",
                                  "extra/counter"}


def test_fallback_gives_only_what_the_checkpoint_lacks(pretrained, make_ckptr,
                                                       mesh8, rng):
  root, truth = pretrained
  scale = random_array(rng, (32,))
  fake_embed = random_array(rng, (64, 32))
  target = {"params": {"embed": {"table": sds(mesh8, (64, 32), "model")},
                       "norm": {"scale": sds(mesh8, (32,), "model")},
                       "bias": np.zeros((32,), np.float32)},
            "epoch": 0, "name": ""}
  fallback = {"params": {
      # The checkpoint has it: the fallback is ignored.
      "embed": {"table": sharded(fake_embed, named(mesh8, "data"))},
      # Laid out differently from the target: resharded.
      "norm": {"scale": sharded(scale, named(mesh8, None))},
      "bias": np.full((32,), 2.0, np.float32)},
      "epoch": 3, "name": "from fallback"}
  out = make_ckptr(root).restore(target=target, fallback_state=fallback)
  assert_placed(out["params"]["embed"]["table"], truth["params/embed/table"],
                named(mesh8, "model"))
  assert_placed(out["params"]["norm"]["scale"], scale, named(mesh8, "model"))
  assert isinstance(out["params"]["bias"], np.ndarray)
  assert same_bits(out["params"]["bias"], np.full((32,), 2.0, np.float32))
  assert out["epoch"] == 3 and out["name"] == "pretrained"


def test_fallback_of_the_wrong_shape_names_the_leaf(pretrained, make_ckptr,
                                                    mesh8):
  root, _ = pretrained
  target = {"params": {"norm": {"scale": sds(mesh8, (32,), "model")}}}
  fallback = {"params": {"norm": {"scale": np.ones((16,), np.float32)}}}
  with pytest.raises(ckpt.TreeMismatchError) as e:
    make_ckptr(root).restore(target=target, fallback_state=fallback)
  assert "'params/norm/scale'" in str(e.value)
  assert "(16,)" in str(e.value) and "(32,)" in str(e.value)


def test_assignment_map_none_entries_come_from_the_fallback_unread(
    pretrained_copy, make_ckptr, mesh8, rng):
  root, truth = pretrained_copy
  remove_array(root, "params/head")  # the map says: do not restore it
  remove_array(root, "opt")
  head = random_array(rng, (32, 16))
  target = {"model": {"embedding": sds(mesh8, (64, 32), None, "model"),
                      "head": sds(mesh8, (32, 16), "data")}}
  fn = T.assignment_map([(r"model/embedding", r"params/embed/table"),
                         (r"model/head", None)])
  out = make_ckptr(root).restore(
      target=target, transforms=[fn],
      fallback_state={"model": {"head": head}})
  assert_placed(out["model"]["embedding"], truth["params/embed/table"],
                named(mesh8, None, "model"))
  assert_placed(out["model"]["head"], head, named(mesh8, "data"))


# ---- lazy=True --------------------------------------------------------------

def test_lazy_restore_returns_leaves_bound_to_the_target(pretrained_copy,
                                                         make_ckptr, mesh8):
  root, truth = pretrained_copy
  scale, fallback = norm_fallback(mesh8)
  target = new_model_target(mesh8)
  # Nothing is read (or even opened) until read(): an array deleted before
  # the restore fails only when its leaf is read.
  remove_array(root, "params/layers_2/attn/w")
  ckptr = make_ckptr(root)
  out = ckptr.restore(target=target, transforms=NEW_MODEL_TRANSFORMS,
                      fallback_state=fallback, lazy=True)
  assert jax.tree.structure(out, is_leaf=lambda v: isinstance(
      v, ckpt.LazyLeaf)) == jax.tree.structure(target)
  assert out["step"] == PRETRAINED_STEP  # python values are not lazy
  want = expected_new_model(truth, scale)
  got = {tree.path_str(p): x for p, x in tree.flatten(out)
         if isinstance(x, ckpt.LazyLeaf)}
  assert set(got) == set(want)
  for parts, t in tree.flatten(target):
    name = tree.path_str(parts)
    if name == "step":
      continue
    leaf = got[name]
    assert leaf.shape == t.shape and leaf.sharding == t.sharding, name
    assert np.dtype(leaf.target_dtype) == F32
    if name == "params/layers/attn/w":
      with pytest.raises(ckpt.CorruptCheckpointError,
                         match="'params/layers_2/attn/w'"):
        leaf.read()
      continue
    assert_placed(leaf.read(), want[name], t.sharding)
  # read() can be asked for another placement.
  other = named(mesh8, ("data", "model"))
  assert_placed(got["params/embedding/table"].read(other),
                want["params/embedding/table"], other)
  ckptr.close()  # lazy leaves outlive the Checkpointer
  assert_placed(got["params/norm/scale"].read(), scale,
                named(mesh8, "model"))
  assert_placed(got["params/layers/mlp/w"].read(),
                want["params/layers/mlp/w"], target["params"]["layers"]["mlp"]
                ["w"].sharding)


def test_lazy_read_async_in_an_asyncio_program(pretrained, make_ckptr, mesh8):
  root, truth = pretrained
  scale, fallback = norm_fallback(mesh8)
  target = new_model_target(mesh8)
  out = make_ckptr(root).restore(target=target, transforms=NEW_MODEL_TRANSFORMS,
                                 fallback_state=fallback, lazy=True)
  lazies = [(tree.path_str(p), x) for p, x in tree.flatten(out)
            if isinstance(x, ckpt.LazyLeaf)]
  names, leaves = [n for n, _ in lazies], [x for _, x in lazies]
  assert len(leaves) == 5

  async def program():
    arrays = await asyncio.gather(*(x.read_async() for x in leaves))
    # A blocking read() from inside a running loop works too.
    one = leaves[0].read()
    return arrays, one

  arrays, one = asyncio.run(program())
  want = expected_new_model(truth, scale)
  for name, leaf, x in zip(names, leaves, arrays):
    assert_placed(x, want[name], leaf.sharding)
  assert_placed(one, want[names[0]], leaves[0].sharding)


def test_lazy_restore_without_a_target_reads_host_values(pretrained,
                                                         make_ckptr):
  root, truth = pretrained
  out = make_ckptr(root).restore(lazy=True, transforms=[T.drop(r"opt/.*")])
  leaves = flat(out)
  assert set(leaves) == {n for n in truth if not n.startswith("opt/")}
  assert leaves["name"] == "pretrained"
  x = leaves["params/layers_1/mlp/w"]
  assert isinstance(x, ckpt.LazyLeaf) and x.sharding is None
  got = x.read()
  assert isinstance(got, np.ndarray)
  assert same_bits(got, truth["params/layers_1/mlp/w"])


def test_restore_dtype_and_target_dtypes_cast_lazy_and_eager(pretrained,
                                                             make_ckptr,
                                                             mesh8):
  root, truth = pretrained
  scale, fallback = norm_fallback(mesh8)
  want = expected_new_model(truth, scale)
  # The target asks for bfloat16: float leaves are cast after reading.
  target = new_model_target(mesh8, dtype=BF16)
  ckptr = make_ckptr(root)
  for lazy_ in (False, True):
    out = ckptr.restore(target=target, transforms=NEW_MODEL_TRANSFORMS,
                        fallback_state=fallback, lazy=lazy_)
    for parts, t in tree.flatten(target):
      name = tree.path_str(parts)
      if name == "step":
        continue
      x = tree_get(out, parts)
      if lazy_:
        assert np.dtype(x.target_dtype) == BF16 and x.dtype == F32, name
        x = x.read()
      assert_placed(x, want[name].astype(BF16), t.sharding)
  # restore_dtype casts every floating leaf, not the integer ones.
  ckptr = make_ckptr(root, restore_dtype="bfloat16")
  target = {"params": {"embed": {"table": sds(mesh8, (64, 32), "model")}},
            "opt": {"count": np.int32(0)}}
  for lazy_ in (False, True):
    out = ckptr.restore(target=target, lazy=lazy_)
    table, count = out["params"]["embed"]["table"], out["opt"]["count"]
    if lazy_:
      table, count = table.read(), count.read()
    assert_placed(table, truth["params/embed/table"].astype(BF16),
                  named(mesh8, "model"))
    assert np.asarray(count).dtype == np.int32 and count == 7
  host = ckptr.restore(transforms=[T.drop(r"opt/mu/.*")])
  assert host["params"]["head"]["w"].dtype == BF16
  assert host["opt"]["count"].dtype == np.int32


def test_casting_a_float_leaf_to_an_integer_target_names_it(pretrained,
                                                            make_ckptr, mesh8):
  root, _ = pretrained
  target = {"params": {"embed": {"table": sds(mesh8, (64, 32), None,
                                             dtype=np.int32)}}}
  for lazy_ in (False, True):
    with pytest.raises(ckpt.TreeMismatchError) as e:
      make_ckptr(root).restore(target=target, lazy=lazy_)
    assert "'params/embed/table'" in str(e.value)
    assert "float32" in str(e.value) and "int32" in str(e.value)


# ---- save transforms --------------------------------------------------------

def test_save_transforms_drop_rename_and_add(make_ckptr, ckpt_dir, rng, mesh8):
  w = random_array(rng, (64, 32))
  mu = random_array(rng, (64, 32))
  state = TrainState(
      params={"w": sharded(w, named(mesh8, "data", "model")),
              "layers": [random_array(rng, (8, 16)),
                         random_array(rng, (8, 16))]},
      opt_state=AdamState(np.int32(3), {"w": mu}, {"w": mu + 1}),
      step=np.int32(12))
  extra = np.arange(100, dtype=np.int32)
  seen = {}

  def migrate(state_dict):
    seen["keys"] = {k: sorted(v) if isinstance(v, dict) else None
                    for k, v in state_dict.items()}
    seen["layers"] = sorted(state_dict["params"]["layers"])
    out = {k: v for k, v in state_dict.items() if k != "opt_state"}
    out["params"] = dict(state_dict["params"])
    out["params"]["kernel"] = out["params"].pop("w")
    out["extra"] = {"ids": extra}
    return out

  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, state, transforms=[migrate])
  # Nested dicts keyed by path parts: custom nodes by field, lists by index.
  assert seen["keys"] == {"params": ["layers", "w"],
                          "opt_state": ["count", "mu", "nu"], "step": None}
  assert seen["layers"] == ["0", "1"]
  loaded = ckpt.load(ckpt_dir)
  assert set(flat(loaded)) == {"params/kernel", "params/layers/0",
                               "params/layers/1", "step", "extra/ids"}
  assert same_bits(loaded["params"]["kernel"], w)
  assert same_bits(loaded["extra"]["ids"], extra)
  assert loaded["step"] == 12
  on_disk = step_dir(ckpt_dir, 1)
  assert not (on_disk / "opt_state").exists()
  assert not (on_disk / "params" / "w").exists()
  assert (on_disk / "params" / "kernel" / ".zarray").is_file()
  # The sharded leaf was saved from its shards and restores onto a mesh.
  target = {"params": {"kernel": sds(mesh8, (64, 32), "model", None)}}
  out = ckptr.restore(target=target)
  assert_placed(out["params"]["kernel"], w, named(mesh8, "model", None))


def test_save_transforms_run_in_order_and_helpers_work_at_save(
    make_ckptr, ckpt_dir, rng):
  state = {"params": {"dense": {"w": random_array(rng, (16, 16))}},
           "opt": {"mu": random_array(rng, (16, 16))}}
  calls = []

  def note(name):
    def fn(state_dict):
      calls.append((name, sorted(flat(state_dict))))
      return state_dict
    return fn

  ckptr = make_ckptr(async_save=False)
  ckptr.save(1, state, transforms=[
      note("a"), T.rename(r"params/(.*)/w", r"params/\1/kernel"), note("b"),
      T.drop(r"opt/.*"), note("c")])
  assert calls == [("a", ["opt/mu", "params/dense/w"]),
                   ("b", ["opt/mu", "params/dense/kernel"]),
                   ("c", ["params/dense/kernel"])]
  loaded = ckpt.load(ckpt_dir)
  assert set(flat(loaded)) == {"params/dense/kernel"}
  assert same_bits(loaded["params"]["dense"]["kernel"],
                   state["params"]["dense"]["w"])


# ---- the docs page runs ------------------------------------------------------

def test_docs_restoring_into_a_changed_model_runs(tmp_path, monkeypatch,
                                                  capsys):
  page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "changed-model.md"
  section = page.read_text()
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert blocks, "no python block on docs/changed-model.md"
  monkeypatch.chdir(tmp_path)
  code = compile("\n".join(blocks), "docs/changed-model.md", "exec")
  exec(code, {})  # pylint: disable=exec-used
  printed = capsys.readouterr().out
  assert "params/layers/w (4, 64, 64)" in printed, printed
