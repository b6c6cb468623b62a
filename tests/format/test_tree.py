"""Leaf names, structure encoding and inline values (ckpt/format/tree.py and the
value half of ckpt/format/index.py)."""

import enum
import math

import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest

import ckpt
from ckpt.format import tree
from ckpt.format import checks
from ckpt.format import inline_values
from tests.conftest import AdamState, TrainState




def names(t):
  return [tree.path_str(p) for p, _ in tree.flatten(t)]


# ---- leaf names ---------------------------------------------------------

def test_path_names_follow_key_paths():
  state = {
      "params": {"encoder": {"layer_0": {"kernel": 1, "bias": 2}}},
      "opt": (AdamState(3, {"w": 4}, {"w": 5}), None),
      "layers": [6, {"w": 7}],
      "by_id": {10: 8, 2: 9},
      "ts": TrainState(params={"w": 10}, opt_state=(), step=11),
  }
  assert names(state) == [
      "by_id/2", "by_id/10",
      "layers/0", "layers/1/w",
      "opt/0/count", "opt/0/mu/w", "opt/0/nu/w",
      "params/encoder/layer_0/bias", "params/encoder/layer_0/kernel",
      "ts/params/w", "ts/step",
  ]
  # The leaf values come along, in the same (jax) order.
  assert [v for _, v in tree.flatten(state)] == jax.tree_util.tree_leaves(state)


def test_none_and_empty_containers_have_no_leaves():
  assert tree.flatten({"a": None, "b": {}, "c": (), "d": []}) == []
  assert tree.flatten(None) == []


def test_single_leaf_state_is_the_root():
  assert tree.flatten(np.float32(1)) == [((), np.float32(1))]
  assert tree.path_str(()) == "<root>"


def test_colliding_paths_are_rejected_naming_the_path():
  with pytest.raises(ckpt.InvalidStateError, match="'a/b'"):
    tree.flatten({"a": {"b": 1}, "a/b": 2})
  with pytest.raises(ckpt.InvalidStateError, match="'x/0'"):
    tree.flatten({"x": [1], "x/0": 2})


def test_unstorable_dict_keys_are_rejected():
  with pytest.raises(ckpt.InvalidStateError, match=r"\(1, 2\)"):
    tree.encode_structure({"outer": {(1, 2): 3}})


# ---- structure encode / decode ------------------------------------------

def roundtrip_structure(state):
  enc = tree.encode_structure(state)
  # What really goes to disk: through msgpack and back.
  enc = msgpack.unpackb(msgpack.packb(enc, use_bin_type=True), raw=False,
                        strict_map_key=False)
  leaves = [v for _, v in tree.flatten(state)]
  # Each leaf is its number in flatten's order, in the place flatten names.
  assert sorted(tree.iter_structure_leaves(enc)) == list(range(len(leaves)))
  assert tree.leaf_paths(enc, len(leaves)) == [
      p for p, _ in tree.flatten(state)]
  return tree.decode_structure(enc, leaves.__getitem__)


def test_structure_round_trip_plain_containers():
  state = {
      "d": {"b": 1, "a": [2, 3, (4, 5)]},
      "ints": {0: "zero", 7: "seven"},
      "none": None,
      "empty_dict": {},
      "empty_tuple": (),
      "empty_list": [],
      "nested_empty": {"x": ({}, [], ())},
      "tuple_with_none": (None, 6),
  }
  out = roundtrip_structure(state)
  assert out == state
  # Types are kept, not just values: tuples stay tuples, int keys stay ints.
  assert type(out["d"]["a"]) is list and type(out["d"]["a"][2]) is tuple
  assert type(out["empty_tuple"]) is tuple and type(out["empty_list"]) is list
  assert list(out["ints"]) == [0, 7]
  assert out["tuple_with_none"] == (None, 6)


def test_structure_round_trip_custom_nodes_become_dicts():
  state = TrainState(
      params={"dense": {"kernel": 1.5, "bias": 2.5}},
      opt_state=(AdamState(count=3, mu={"w": 4}, nu={"w": 5}), ()),
      step=6)
  out = roundtrip_structure(state)
  assert out == {
      "params": {"dense": {"bias": 2.5, "kernel": 1.5}},
      "opt_state": ({"count": 3, "mu": {"w": 4}, "nu": {"w": 5}}, ()),
      "step": 6,
  }
  enc = tree.encode_structure(state)
  assert enc[:2] == ["object", "TrainState"] and enc[4] == "opt_state"
  assert enc[5][0] == "tuple" and enc[5][1][:4] == [
      "object", "AdamState", "count", 2]


def test_structure_fast_path_numbers_leaves_as_jax_flattens_them():
  """encode_structure walks plain dicts (str keys), lists and tuples and
  known leaf types itself (issue 47: a tree_flatten per node was a sixth
  of a first save of 10,000 leaves); every other node goes through jax.
  Either way each leaf's number and place are flatten's."""
  import collections  # pylint: disable=g-import-not-at-top
  pair = collections.namedtuple("pair", "b a")
  state = {"10": np.zeros(2), "9": [jax.numpy.ones(3), (1.0, None)],
           "od": collections.OrderedDict([("z", 1), ("a", 2)]),
           "dd": collections.defaultdict(int, {"y": 3, "x": 4}),
           "nt": pair(b=5, a={"q": 6, "p": np.float32(7)}),
           "ints": {2: 8, 1: 9}, "e": {"": 10, "A": 11, "a": 12}}
  for _ in range(2):  # the second time the leaf types are known
    out = roundtrip_structure(state)
    assert [k for k in out] == sorted(state)
    assert out["9"][1] == (1.0, None) and out["e"] == state["e"]
    assert list(out["od"]) == ["z", "a"] and out["nt"] == {
        "b": 5, "a": {"p": np.float32(7), "q": 6}}


def test_structure_of_a_bare_leaf_and_of_none():
  assert roundtrip_structure(np.int32(5)) == np.int32(5)
  assert roundtrip_structure(None) is None
  assert roundtrip_structure({}) == {}
  assert roundtrip_structure(()) == ()


# ---- storage paths ----------------------------------------------------------

def test_storage_relpath_keeps_plain_names():
  assert tree.storage_relpath(("params", "layer_0", "kernel")) == \
      "params/layer_0/kernel"
  assert tree.storage_relpath(("opt", "0", "mu.w")) == "opt/0/mu.w"
  assert tree.storage_relpath(()) == "_root"


@pytest.mark.parametrize("part", ["..", ".", ".hidden", "a b", "a/b", "",
                                  "\u20ac", "x\u00e9", "%", "a\\b", "C:"])
def test_storage_relpath_of_odd_names_is_accepted_by_the_index(part):
  rel = tree.storage_relpath(("top", part))
  assert rel.startswith("top/") and rel.count("/") == 1
  assert checks.check_relpath(rel, "here") == rel  # restore will accept it


def test_storage_relpath_is_one_to_one():
  parts = ["a b", "a%20b", "a_b", "a-b", "a.b", "\u20ac", " AC", "%20AC",
           ".x", "%2Ex", "", "%", "..", ".", "A", "a"]
  rels = [tree.storage_relpath(("p", q)) for q in parts]
  assert len(set(rels)) == len(rels), dict(zip(parts, rels))


# ---- inline values ----------------------------------------------------------

def value_roundtrip(v):
  enc = inline_values.encode_value(v, ("leaf",))
  enc = msgpack.unpackb(msgpack.packb(enc, use_bin_type=True), raw=False)
  return inline_values.decode_value(enc, "leaf")


@pytest.mark.parametrize("v", [
    True, False, 0, -7, 2**63 - 1, -2**63, 2**64 - 1, 1.5, -0.0, math.inf,
    "", "héllo", b"", b"\x00\xffbytes",
])
def test_inline_python_values(v):
  out = value_roundtrip(v)
  assert type(out) is type(v)
  assert out == v
  if isinstance(v, float):
    assert math.copysign(1, out) == math.copysign(1, v)


def test_inline_nan():
  out = value_roundtrip(float("nan"))
  assert type(out) is float and math.isnan(out)


@pytest.mark.parametrize("v", [
    np.float32(1.25), np.float64(-3e300), np.int8(-5), np.uint64(2**64 - 1),
    np.int64(-2**63), np.bool_(True), np.float16(0.5),
    ml_dtypes.bfloat16(3.5), np.complex64(1 + 2j),
])
def test_inline_numpy_scalars(v):
  out = value_roundtrip(v)
  assert type(out) is type(v)
  assert out.dtype == v.dtype
  assert out.tobytes() == v.tobytes()


def test_inline_numpy_arrays(rng):
  for arr in [
      rng.standard_normal((3, 4)).astype(np.float32),
      rng.standard_normal((5,)).astype(ml_dtypes.bfloat16),
      rng.integers(-100, 100, (2, 3, 2), dtype=np.int16),
      rng.random((4,)) < 0.5,
      np.asarray(rng.standard_normal()),          # 0-d array stays 0-d array
      np.zeros((0, 3), np.float32),
  ]:
    out = value_roundtrip(arr)
    assert isinstance(out, np.ndarray)
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tobytes() == arr.tobytes()


class Color(enum.IntEnum):
  RED = 3


class Mode(str, enum.Enum):
  TRAIN = "train"


class Meters(float):
  pass


@pytest.mark.parametrize("v,plain", [
    (Color.RED, 3), (Mode.TRAIN, "train"), (Meters(2.5), 2.5),
])
def test_inline_subclasses_of_python_types_store_their_base_value(v, plain):
  out = value_roundtrip(v)
  assert type(out) is type(plain) and out == plain


def test_inline_big_endian_arrays_keep_their_values(rng):
  for dtype in [">f4", ">i8", ">c8", ">u2"]:
    arr = random_array_of(rng, dtype)
    out = value_roundtrip(arr)
    assert out.dtype == arr.dtype.newbyteorder("=")
    np.testing.assert_array_equal(out, arr)


def random_array_of(rng, dtype):
  dtype = np.dtype(dtype)
  if dtype.kind in "iu":
    return rng.integers(0, 1000, (6,)).astype(dtype)
  return (rng.standard_normal(6) + (1j if dtype.kind == "c" else 0) *
          rng.standard_normal(6)).astype(dtype)


def test_inline_rejects_what_cannot_be_stored():
  with pytest.raises(ckpt.InvalidStateError, match="'a/b'.*64 bits"):
    inline_values.encode_value(2**64, ("a", "b"))
  with pytest.raises(ckpt.InvalidStateError, match="'a'.*object"):
    inline_values.encode_value(np.array([object()]), ("a",))
  with pytest.raises(ckpt.InvalidStateError, match="'a'.*<U"):
    inline_values.encode_value(np.array(["text"]), ("a",))


@pytest.mark.parametrize("bad,fragment", [
    ({"py": "set", "v": 1}, "bool, int, float, str or bytes"),
    ({"py": "int", "v": "1"}, "bool, int, float, str or bytes"),
    ({"py": "bool", "v": 1}, "bool, int, float, str or bytes"),
    ({"py": ["int"], "v": 1}, "bool, int, float, str or bytes"),
    ({"np": "float32", "shape": [2], "data": b"\x00" * 7}, "8 data bytes"),
    ({"np": "float32", "shape": [2], "data": "00000000"}, "8 data bytes"),
    ({"np": "object", "shape": [], "data": b""}, "dtype name"),
    ({"np": ["float32"], "shape": [1], "data": b"\x00" * 4}, "dtype name"),
    ({"np": "int8", "shape": [1.0], "data": b"\x00"}, "shape"),
    ({"np": "int8", "shape": "1", "data": b"\x00"}, "shape"),
    ([1, 2], "inline value map"),
])
def test_inline_decode_rejects_garbage(bad, fragment):
  with pytest.raises(ckpt.CorruptCheckpointError) as e:
    inline_values.decode_value(bad, "leaf 'w/x'")
  assert "leaf 'w/x'" in str(e.value) and fragment in str(e.value)
