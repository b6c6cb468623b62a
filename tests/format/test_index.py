"""index.msgpack: encode/decode round trip and validation (ckpt/format/index.py).

Every rejection is a CorruptCheckpointError whose message names the file and
the field (or leaf) at fault.
"""

import copy
import dataclasses
import typing

import ml_dtypes
import msgpack
from tests import sealed
import numpy as np
import pytest

import ckpt
from ckpt.format import index
from ckpt.format import index_codec
from ckpt.format import tsspec
from ckpt.format import tree

WHERE = "/ckpts/checkpoint_7/index.msgpack"


class _State(typing.NamedTuple):
  """A state whose leaves flatten in the order make_index lists them."""
  params: dict
  step: int
  name: int
  opt: tuple


def make_index(rng):
  state_like = _State({"w": 0, "b": 0}, 0, 0, (None, {}))
  structure = tree.encode_structure(state_like)
  leaves = (
      index.ArrayEntry(path=("params", "b"), relpath="params/b", shape=(16,),
                       dtype="bfloat16", chunks=(16,),
                       codec={"compression": None, "level": 1},
                       source_dtype="float32",
                       sharding="NamedSharding(mesh={'x': 8}, spec=('x',))"),
      index.ArrayEntry(path=("params", "w"), relpath="params/w",
                       shape=(64, 32), dtype="float32", chunks=(8, 32),
                       codec={"compression": "zstd", "level": 3},
                       source_dtype="float32"),
      index.ValueEntry(path=("step",), value=np.int64(12345)),
      index.ValueEntry(path=("name",),
                       value=rng.standard_normal(3).astype(ml_dtypes.bfloat16)),
  )
  return index.Index(step=7, time=1.7e9, storage_format="zarr3",
                     process_count=2, structure=structure, leaves=leaves,
                     metrics={"eval/loss": 0.25, "acc": 1},
                     host_state=(sealed.packb({"seed": 1}), b"\x90"))


def doc_of(idx):
  """The index's document, its leaves as version 1's maps (to edit)."""
  doc = sealed.unpackb(index.encode(idx), raw=False, strict_map_key=False)
  doc["leaves"] = index_codec.rows(doc["leaves"])
  return doc


def pack(doc):
  """The document as the index of today's version (edited leaf maps as
  columns, so the version-2 decoder meets them)."""
  if isinstance(doc, dict) and isinstance(doc.get("leaves"), list):
    doc = {**doc, "leaves": index_codec.columns(doc["leaves"], index.KINDS)}
  return sealed.packb(doc, use_bin_type=True)


def rejected(data, *fragments):
  with pytest.raises(ckpt.CorruptCheckpointError) as e:
    index.decode(data, WHERE)
  msg = str(e.value)
  assert WHERE in msg, msg
  for f in fragments:
    assert f in msg, f"{f!r} not in {msg!r}"
  return msg


# ---- round trip -------------------------------------------------------------

def test_round_trip(rng):
  idx = make_index(rng)
  out = index.decode(index.encode(idx), WHERE)
  assert (out.step, out.time, out.storage_format, out.process_count) == \
      (7, 1.7e9, "zarr3", 2)
  assert out.metrics == {"eval/loss": 0.25, "acc": 1}
  assert out.host_state == idx.host_state
  assert out.structure == idx.structure
  assert out.leaves[:2] == idx.leaves[:2]  # ArrayEntry: all fields equal
  assert out.leaves[2].value == np.int64(12345)
  assert type(out.leaves[2].value) is np.int64
  assert out.leaves[3].value.tobytes() == idx.leaves[3].value.tobytes()
  assert out.leaves[3].value.dtype == ml_dtypes.bfloat16
  assert [tree.path_str(e.path) for e in out.leaves] == [
      "params/b", "params/w", "step", "name"]


def test_round_trip_without_optional_fields(rng):
  doc = doc_of(make_index(rng))
  doc["host_state"] = None
  del doc["metrics"]
  for leaf in doc["leaves"]:
    leaf.pop("sharding", None)
    leaf.pop("source_dtype", None)
  out = index.decode(pack(doc), WHERE)
  assert out.host_state is None and out.metrics == {}
  assert out.leaves[0].source_dtype == "bfloat16"  # defaults to dtype


def test_encoded_index_uses_no_pickle_or_extension_types(rng):
  data = index.encode(make_index(rng))

  def no_ext(code, payload):
    raise AssertionError(f"extension type {code} in the index")

  sealed.unpackb(data, raw=False, strict_map_key=False, ext_hook=no_ext)
  assert b"pickle" not in data and b"\x80\x04" not in data


# ---- rejections: the document -------------------------------------------

def test_rejects_truncated_bytes(rng):
  data = index.encode(make_index(rng))
  for cut in (1, len(data) // 3, len(data) - 1):
    rejected(data[:cut], "not a valid msgpack")


def test_rejects_empty_and_non_msgpack():
  rejected(b"", "not a valid msgpack")
  rejected(b"\xc1\xc1\xc1", "not a valid msgpack")  # 0xc1 is never used
  rejected(b'{"format": "ckpt", "version": 1}', "not a valid msgpack")
  rejected(b"\x80\x04\x95" + b"\x00" * 20, "not a valid msgpack")  # pickle


def test_rejects_non_map_document():
  rejected(pack([1, 2, 3]), "expected a map", "[1, 2, 3]")
  rejected(pack("ckpt"), "expected a map")


@pytest.mark.parametrize("field,value,fragments", [
    ("format", "orbax", ["format 'ckpt'", "'orbax'"]),
    ("format", None, ["format 'ckpt'", "None"]),
    ("version", 7, ["version 1 or 2 or 3 or 4 or 5 or 6", "7"]),
    ("version", "1", ["version 1 or 2 or 3 or 4 or 5 or 6", "'1'"]),
    ("step", -1, ["step", "-1"]),
    ("step", 1.0, ["step", "1.0"]),
    ("step", True, ["step", "True"]),
    ("process_count", "2", ["process_count", "'2'"]),
    ("time", "noon", ["numeric time", "'noon'"]),
    ("storage_format", "n5", ["storage_format", "'n5'"]),
    ("storage_format", ["zarr"], ["storage_format", "['zarr']"]),
    ("metrics", {"loss": "low"}, ["metrics", "'low'"]),
    ("metrics", [1.0], ["metrics"]),
    ("leaves", {"a": 1}, ["leaves columns among", "'a'"]),
    ("host_state", [b"ok", "not bytes"], ["host_state", "'not bytes'"]),
    ("host_state", b"\x90", ["host_state"]),
    ("host_states", -1, ["host_states", "-1"]),
    ("host_states", "2", ["host_states", "'2'"]),
    ("host_states", True, ["host_states", "True"]),
    ("host_states", (1 << 20) + 1, ["host_states", "1048577"]),
])
def test_rejects_bad_header_fields(rng, field, value, fragments):
  doc = doc_of(make_index(rng))
  doc[field] = value
  rejected(pack(doc), *fragments)


# ---- rejections: leaf entries -------------------------------------------

def with_leaf(rng, i, **changes):
  doc = doc_of(make_index(rng))
  leaf = doc["leaves"][i]
  for k, v in changes.items():
    if v is KeyError:
      del leaf[k]
    else:
      leaf[k] = v
  return pack(doc)


@pytest.mark.parametrize("relpath", [
    "/etc/passwd", "../outside", "params/../../x", "params/..", "./params",
    "params//w", "params/w/", "", ".hidden", "a\\..\\b", "..", 5,
    ["params", "w"],
])
def test_rejects_relpaths_outside_the_checkpoint(rng, relpath):
  msg = rejected(with_leaf(rng, 1, relpath=relpath), "leaf 1", "params/w")
  assert repr(relpath) in msg or "a relative path" in msg


def test_accepts_escaped_relpaths(rng):
  rel = tree.storage_relpath(("we ird", "..", ".x"))
  out = index.decode(with_leaf(rng, 1, relpath=rel), WHERE)
  assert out.leaves[1].relpath == rel


@pytest.mark.parametrize("dtype", ["object", "<U3", "str", "float128", "",
                                   None, 7, ["float32"], {"name": "float32"}])
def test_rejects_bad_dtypes(rng, dtype):
  rejected(with_leaf(rng, 1, dtype=dtype), "leaf 1 (params/w)",
           "known dtype name", repr(dtype)[:20])


def test_rejects_bad_source_dtype(rng):
  rejected(with_leaf(rng, 0, source_dtype="object"), "leaf 0 (params/b)",
           "known dtype name", "'object'")


@pytest.mark.parametrize("shape", [
    [64.0, 32], "64,32", [True, 32], [-1, 32], [[64], 32], None, {"0": 64},
    [2**62, 1], [1] * 65,
])
def test_rejects_shapes_that_are_not_lists_of_ints(rng, shape):
  rejected(with_leaf(rng, 1, shape=shape), "leaf 1 (params/w)", "a shape")


@pytest.mark.parametrize("chunks,fragment", [
    ([8], "2 positive chunk extents"),
    ([8, 0], "2 positive chunk extents"),
    ([8.0, 32], "a shape"),
    (None, "a shape"),
])
def test_rejects_bad_chunks(rng, chunks, fragment):
  rejected(with_leaf(rng, 1, chunks=chunks), "leaf 1 (params/w)", fragment)


@pytest.mark.parametrize("changes,fragment", [
    ({"kind": "pickle"}, "kind 'array' or 'value'"),
    ({"kind": KeyError}, "kind 'array' or 'value'"),
    ({"codec": {"compression": "gzip"}}, "compression"),
    ({"codec": "zstd"}, "compression"),
    ({"sharding": 3}, "sharding as a string"),
    ({"path": "params/w"}, "path as a list"),
    ({"path": ["params", 3]}, "path as a list"),
])
def test_rejects_bad_entry_fields(rng, changes, fragment):
  rejected(with_leaf(rng, 1, **changes), "leaf 1", fragment)


def test_rejects_bad_inline_value(rng):
  rejected(with_leaf(rng, 2, value={"py": "int", "v": "12345"}),
           "leaf 2 (step)", "bool, int, float, str or bytes")
  rejected(with_leaf(rng, 3, value={"np": "bfloat16", "shape": [3],
                                    "data": b"\x00" * 5}),
           "leaf 3 (name)", "6 data bytes")
  rejected(with_leaf(rng, 2, value=None), "leaf 2 (step)", "inline value map")


def test_rejects_non_map_leaf(rng):
  doc = doc_of(make_index(rng))
  doc["leaves"][0] = ["params", "b"]
  rejected(pack(doc), "leaf 0", "expected path as a list")
  doc = sealed.unpackb(index.encode(make_index(rng)), raw=False)
  doc["leaves"]["specs"][0] = ["params", "b"]
  rejected(pack(doc), "leaf 0 (params/b)", "a spec map of kind",
           "['params', 'b']")


# ---- version 2: the leaves' columns and tables (ckpt/format/index_codec.py) -----

def columns_of(rng):
  return sealed.unpackb(index.encode(make_index(rng)), raw=False)


@pytest.mark.parametrize("edit,fragments", [
    (lambda c: c["spec"].__setitem__(1, 9), ["leaf 1:", "spec number in [0, "]),
    (lambda c: c["spec"].__setitem__(1, -1), ["leaf 1:", "spec number"]),
    (lambda c: c["spec"].__setitem__(1, True), ["leaf 1:", "spec number"]),
    (lambda c: c["spec"].__setitem__(1, 0), ["every spec used by a leaf"]),
    (lambda c: c["spec"].append(0), ["leaves path as 5 lists"]),
    (lambda c: c["path"][2].append(99), ["leaf 2:", "numbers into the"]),
    (lambda c: c["path"].__setitem__(3, [-1]), ["leaf 3:", "path as a list"]),
    (lambda c: c["path"].__setitem__(3, "name"), ["leaf 3:", "path as a list"]),
    (lambda c: c["names"].__setitem__(0, 7), ["names as a list of strings"]),
    (lambda c: c.__setitem__("specs", {}), ["specs as a list of maps"]),
    (lambda c: c.__setitem__("relpath", [None]), ["column relpath as a list of 4"]),
    (lambda c: c.__setitem__("pack", [None] * 4), ["columns among", "'pack'"]),
    (lambda c: c.__setitem__("spec", "0"), ["spec as a list of numbers"]),
])
def test_rejects_bad_columns(rng, edit, fragments):
  doc = columns_of(rng)
  edit(doc["leaves"])
  rejected(pack(doc), *fragments)


def test_specs_and_path_parts_are_stored_once(rng):
  """Leaves that differ only in their path share a spec; a relpath that
  the path gives is not stored; each path part is stored once."""
  entries = tuple(index.ArrayEntry(
      path=("params", f"layer_{i:02d}", "w"), relpath=f"params/layer_{i:02d}/w",
      shape=(8, 4), dtype="float32", chunks=(8, 4), codec={"compression": None},
      source_dtype="float32") for i in range(50))
  idx = index.Index(step=1, time=0.0, storage_format="zarr", process_count=1,
                    structure=tree.encode_structure(
                        {"params": {f"layer_{i:02d}": {"w": 0}
                                    for i in range(50)}}),
                    leaves=entries)
  cols = sealed.unpackb(index.encode(idx), raw=False)["leaves"]
  assert len(cols["specs"]) == 1 and cols["spec"] == [0] * 50
  assert len(cols["names"]) == 52 and "relpath" not in cols
  assert index.decode(index.encode(idx)).leaves == entries
  # A relpath other than the path's is kept, and checked.
  odd = dataclasses.replace(entries[0], relpath="elsewhere/w0")
  idx = dataclasses.replace(idx, leaves=(odd, *entries[1:]))
  assert index.decode(index.encode(idx)).leaves[0].relpath == "elsewhere/w0"


def test_a_relpath_derived_from_hostile_path_parts_stays_inside(rng):
  """A leaf without a stored relpath gets the one its path gives, escaped
  (tree.storage_relpath): no path part can make it leave the step."""
  doc = doc_of(make_index(rng))
  assert "relpath" not in doc["leaves"][1]  # params/w: the path's own
  doc["leaves"][1]["path"] = ["..", "/etc", ".hidden", ""]
  e = index.decode(pack(doc), WHERE).leaves[1]
  assert e.relpath == "%2E%2E/%2Fetc/%2Ehidden/%"
  index.check_relpath(e.relpath, "here")


def old_doc(doc, version):
  """``doc`` (leaves as maps) as an index of ``version`` 1 or 2 writes it."""
  names = [tree.path_str(tuple(leaf["path"])) for leaf in doc["leaves"]]
  return {**doc, "version": version,
          "structure": tree.named(doc["structure"], names)}


def test_structure_leaves_are_leaf_numbers(rng):
  """Version 3 writes a leaf of the tree structure as its number among the
  leaves (an int), its path only once (in the leaves)."""
  idx = make_index(rng)
  doc = sealed.unpackb(index.encode(idx), raw=False)
  assert doc["version"] == index.VERSION == 6
  assert doc["structure"] == [
      "object", "_State", "params", ["dict", "b", 0, "w", 1], "step", 2,
      "name", 3, "opt", ["tuple", ["none"], ["dict"]]]
  values = [tree.path_str(e.path) for e in index.decode(pack(doc)).leaves]
  assert tree.decode_structure(doc["structure"], values.__getitem__) == {
      "params": {"b": "params/b", "w": "params/w"}, "step": "step",
      "name": "name", "opt": (None, {})}


@pytest.mark.parametrize("version", [1, 2])
def test_older_structures_decode_as_leaf_numbers(rng, version):
  """Versions 1 and 2 name each leaf of the structure by its path: read as
  before, then held as today's (leaf numbers), whatever the leaves' order."""
  idx = make_index(rng)
  doc = old_doc(doc_of(idx), version)
  if version == 1:
    for leaf in doc["leaves"][:2]:  # version 1 spells out every relpath
      leaf["relpath"] = "/".join(leaf["path"])
  doc["leaves"] = doc["leaves"][::-1]  # the structure names them by path
  data = (sealed.packb(doc, use_bin_type=True) if version == 1 else
          pack(doc))
  out = index.decode(data, WHERE)
  assert [e.path for e in out.leaves] == [e.path for e in idx.leaves][::-1]
  values = [tree.path_str(e.path) for e in out.leaves]
  assert tree.decode_structure(out.structure, values.__getitem__) == {
      "params": {"b": "params/b", "w": "params/w"}, "step": "step",
      "name": "name", "opt": (None, {})}
  assert sorted(tree.iter_structure_leaves(out.structure)) == [0, 1, 2, 3]


def test_version_1_leaf_maps_still_decode(rng):
  idx = make_index(rng)
  doc = old_doc(doc_of(idx), 1)
  for leaf in doc["leaves"][:2]:  # version 1 spells out every relpath
    leaf["relpath"] = "/".join(leaf["path"])
  out = index.decode(sealed.packb(doc, use_bin_type=True), WHERE)
  assert out.leaves[:2] == idx.leaves[:2] and out.structure == idx.structure
  doc["leaves"][1]["relpath"] = None  # version 1 has no derived relpaths
  with pytest.raises(ckpt.CorruptCheckpointError, match="leaf 1"):
    index.decode(sealed.packb(doc, use_bin_type=True), WHERE)


def test_rejects_duplicate_leaf_paths(rng):
  doc = doc_of(make_index(rng))
  doc["leaves"].append(copy.deepcopy(doc["leaves"][1]))
  rejected(pack(doc), "duplicate leaf paths", "params/w")


# ---- rejections: structure vs leaves ----------------------------------------

def test_rejects_structure_leaf_mismatch(rng):
  """Every leaf number once, each in range(number of leaves)."""
  doc = doc_of(make_index(rng))
  doc["leaves"] = doc["leaves"][:3]  # the structure's leaf 3 has no entry
  rejected(pack(doc), "structure and leaves disagree",
           "expected the leaf numbers 0 to 2 each once, found 4 numbers",
           "out of range: [3]")
  doc = doc_of(make_index(rng))
  assert doc["structure"][4:6] == ["step", 2]
  doc["structure"][5] = 0  # leaf 0 twice, leaf 2 nowhere
  rejected(pack(doc), "structure and leaves disagree",
           "more than once: [0]", "missing: [2]")
  doc["structure"][5] = -2
  rejected(pack(doc), "out of range: [-2]", "missing: [2]")
  doc["structure"][5] = 2**64 - 1
  rejected(pack(doc), f"out of range: [{2**64 - 1}]")
  doc["structure"][9].append(9)  # and one too many (in the opt tuple)
  rejected(pack(doc), "found 5 numbers")


def test_rejects_structure_leaf_mismatch_in_older_versions(rng):
  doc = old_doc(doc_of(make_index(rng)), 2)
  doc["leaves"] = [l for l in doc["leaves"] if l["path"] != ["params", "w"]]
  rejected(pack(doc), "structure and leaves disagree",
           "without an entry: ['params/w']")
  doc = old_doc(doc_of(make_index(rng)), 2)
  doc["leaves"][1]["path"] = ["params", "v"]
  rejected(pack(doc), "structure and leaves disagree", "'params/w'",
           "not in the structure: ['params/v']")
  doc["structure"] = 1  # a leaf number in a version 2 index
  doc["leaves"] = []
  rejected(pack(doc), "a structure node map")


_MALFORMED = [
    ([], "a structure node map"),
    ({"node": "set", "children": []}, "a node kind"),
    ({"node": "dict", "keys": ["a"], "children": []}, "0 keys"),
    ({"node": "list", "children": {"a": 1}}, "a list of children"),
    ({"node": "dict", "keys": [["a"]], "children": [{"node": "none"}]},
     "dict keys of type str or int"),
    ({"node": "dict", "keys": [1.5], "children": [{"node": "none"}]},
     "dict keys of type str or int"),
    ({"node": "object", "type": "T", "keys": [1],
      "children": [{"node": "none"}]}, "object keys of type str"),
]


_NODE = "a structure node (a list: its kind, then its children) or a leaf"


@pytest.mark.parametrize("structure,fragment", [
    ({"node": "list", "children": []}, _NODE),  # versions 1 and 2's node
    ({"leaf": 0}, _NODE),
    ([], _NODE),
    (["list", True], _NODE),
    (["list", "a"], _NODE),
    (["list", 0.0], _NODE),
    (["list", ["tuple", None]], _NODE),
    (["set"], "a node kind"),
    ([["list"]], "a node kind"),  # (not hashable)
    (["none", ["none"]], "a node kind (dict, list, tuple, object, or none "
     "with no children)"),
    (["dict", "a"], "keys and children in pairs"),
    (["dict", ["a"], ["none"]], "dict keys of type str or int"),
    (["dict", 1.5, ["none"]], "dict keys of type str or int"),
    (["dict", True, ["none"]], "dict keys of type str or int"),
    (["object", "T", 1, ["none"]], "object keys of type str"),
    (["object", 3, "a", ["none"]], "an object node's type name"),
    (["object", "T", "a"], "an object node's type name, then its keys and "
     "children in pairs"),
])
def test_rejects_malformed_structure(rng, structure, fragment):
  doc = doc_of(make_index(rng))
  doc["structure"] = structure
  doc["leaves"] = []
  rejected(pack(doc), fragment)


@pytest.mark.parametrize("structure,fragment", _MALFORMED + [
    ({"leaf": 3}, "a leaf name"),
    (["list", 0], "a structure node map"),  # version 3's node
])
def test_rejects_malformed_structure_in_older_versions(rng, structure,
                                                       fragment):
  doc = doc_of(make_index(rng))
  doc["version"], doc["structure"], doc["leaves"] = 2, structure, []
  rejected(pack(doc), fragment)


@pytest.mark.parametrize("version", [2, 3])
def test_rejects_too_deep_structure(rng, version):
  doc = doc_of(make_index(rng))
  node = {"node": "none"} if version < 3 else ["none"]
  for _ in range(index.MAX_DEPTH + 5):
    node = ({"node": "list", "children": [node]} if version < 3 else
            ["list", node])
  doc["version"], doc["structure"], doc["leaves"] = version, node, []
  rejected(pack(doc), "deeper than")


def test_depth_limit_counts_a_leaf_below_its_node(rng):
  """As in version 2, a leaf is one level below its node: a leaf at depth
  MAX_DEPTH is read, one deeper is refused."""
  doc = doc_of(make_index(rng))
  doc["leaves"] = doc["leaves"][:1]
  for depth, ok in ((index.MAX_DEPTH, True), (index.MAX_DEPTH + 1, False)):
    node = 0
    for _ in range(depth):
      node = ["list", node]
    doc["structure"] = node
    if ok:
      assert index.decode(pack(doc), WHERE).structure == node
    else:
      rejected(pack(doc), "deeper than")


def test_structure_with_int_keys_decodes(rng):
  state = {"layers": {0: 1, 1: 2}}
  doc = doc_of(make_index(rng))
  doc["structure"] = tree.encode_structure(state)
  doc["leaves"] = [index.ValueEntry(p, v).to_json()
                   for p, v in tree.flatten(state)]
  out = index.decode(pack(doc), WHERE)
  values = [e.value for e in out.leaves]
  assert tree.decode_structure(out.structure, values.__getitem__) == state


def _plan(n_leaves=200):
  from ckpt.save import leaves as leaves_lib  # pylint: disable=g-import-not-at-top
  from ckpt.save import write as save_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  state = {f"layer_{i}": {"w": rng.standard_normal((64, 32)).astype(np.float32),
                          "step": i}
           for i in range(n_leaves)}
  # Over ckpt.save.pack.MAX_LEAF_BYTES: a TensorStore array (the others packed).
  state["embed"] = rng.standard_normal((256, 128)).astype(np.float32)
  return save_lib, leaves_lib.plan_save(
      state, leaves_lib.SaveOptions(
          storage_format="zarr3", codec=tsspec.Codec(checksum="crc32c")),
      process_count=1)


def test_index_size_does_not_grow_with_process_count():
  """The same leaves saved as if by 2 and by 1,024 processes: the index
  differs only in the process_count integer (1 vs 3 msgpack bytes)."""
  save_lib, plan = _plan()
  sizes = {}
  for n in (1, 2, 1024, 4096):
    idx = save_lib.make_index(plan, 5, {"loss": 1.0}, n)
    assert idx.host_state is None
    assert all(not e.checksums for e in idx.leaves
               if isinstance(e, index.ArrayEntry))
    sizes[n] = len(index.encode(dataclasses.replace(idx, time=0.0)))
  assert sizes[1] == sizes[2], sizes
  assert 0 <= sizes[1024] - sizes[2] <= 2, sizes
  assert sizes[1024] == sizes[4096], sizes
  out = index.decode(index.encode(save_lib.make_index(plan, 5, None, 1024)))
  assert out.process_count == 1024 and out.host_state is None
  arrays = [e for e in out.leaves if isinstance(e, index.ArrayEntry)]
  assert arrays and all(e.codec["checksum"] == "crc32c" for e in arrays)
  assert sum(isinstance(e, index.PackedEntry) for e in out.leaves) == 200


def test_zarr_v2_entries_have_no_checksum_codec():
  from ckpt.save import leaves as leaves_lib  # pylint: disable=g-import-not-at-top
  save_lib, _ = _plan(1)
  plan = leaves_lib.plan_save({"w": np.zeros((256, 128), np.float32)},
                              leaves_lib.SaveOptions(storage_format="zarr"),
                              process_count=1)
  e = save_lib.make_index(plan, 1, None, 2).leaves[0]
  assert "checksum" not in e.codec


def test_rejects_a_checksum_codec_it_does_not_know(rng):
  rejected(with_leaf(rng, 1, codec={"compression": None, "checksum": "md5"}),
           "leaf 1", "codec checksum")
  doc = doc_of(make_index(rng))
  doc["storage_format"] = "zarr"
  doc["leaves"][1]["codec"]["checksum"] = "crc32c"
  rejected(pack(doc), "leaf 1 (params/w)", "format zarr v2 has none")


# ---- encode refuses what decode refuses -------------------------------------

def _refused(idx, *fragments):
  with pytest.raises(ckpt.InvalidStateError) as e:
    index.encode(idx)
  msg = str(e.value)
  for f in fragments:
    assert f in msg, f"{f!r} not in {msg!r}"
  return msg


def _value_index(n):
  leaves = {f"v{i}": i for i in range(n)}
  return index.Index(
      step=3, time=0.0, storage_format="zarr", process_count=1,
      structure=tree.encode_structure(leaves),
      leaves=tuple(index.ValueEntry(p, v) for p, v in tree.flatten(leaves)))


def test_encode_refuses_an_index_over_the_byte_limit(monkeypatch):
  idx = _value_index(50)
  size = len(index.encode(idx))
  monkeypatch.setattr(index, "MAX_INDEX_BYTES", size - 1)
  msg = _refused(idx, "step 3", "MAX_INDEX_BYTES", f"is {size}",
                 f"limit is {size - 1}", "nothing was committed")
  # Exactly at the limit it is written, and it decodes.
  monkeypatch.setattr(index, "MAX_INDEX_BYTES", size)
  assert len(index.decode(index.encode(idx)).leaves) == 50
  assert "50 leaves" in msg


def test_encode_refuses_too_long_a_container(monkeypatch):
  idx = _value_index(50)
  data = index.encode(idx)
  monkeypatch.setattr(index, "MAX_CONTAINER_LEN", 20)
  # the longest: the structure's dict node, its 50 keys and 50 leaves
  _refused(idx, "MAX_CONTAINER_LEN", "is 101", "limit is 20")
  with pytest.raises(ckpt.CorruptCheckpointError):  # as decode refuses it
    index.decode(data)


@pytest.mark.parametrize("name", ["_LISTS_PER_BYTE", "_MAPS_PER_BYTE"])
def test_encode_refuses_more_containers_than_decode_allows(monkeypatch, name):
  idx = _value_index(200)
  data = index.encode(idx)
  monkeypatch.setattr(index, name, 10**9)  # then at most 64 of them
  _refused(idx, name, "limit is 64")
  with pytest.raises(ckpt.CorruptCheckpointError):
    index.decode(data)


def test_encode_refuses_too_deep_a_tree():
  node = 0
  for _ in range(index.MAX_DEPTH + 1):
    node = ["list", node]
  idx = index.Index(step=4, time=0.0, storage_format="zarr", process_count=1,
                    structure=node, leaves=(index.ValueEntry(("x",), 1),))
  _refused(idx, "tree depth", f"is {index.MAX_DEPTH + 1}",
           f"limit is {index.MAX_DEPTH}", "MAX_DEPTH")


def test_a_save_over_the_limit_fails_and_keeps_earlier_checkpoints(
    monkeypatch, tmp_path):
  root = tmp_path / "ckpts"
  small = {f"v{i}": np.full((80,), i, np.float32) for i in range(5)}
  with ckpt.Checkpointer(root, async_save=False) as c:
    c.save(1, small, host_state={"rng": 1})
    size = len((root / "checkpoint_1" / "index.msgpack").read_bytes())
    monkeypatch.setattr(index, "MAX_INDEX_BYTES", size + 10)
    big = {f"v{i}": np.full((80,), i, np.float32) for i in range(50)}
    with pytest.raises(ckpt.CheckpointError, match="MAX_INDEX_BYTES") as e:
      c.save(2, big, host_state={"rng": 2})
    assert f"limit is {size + 10}" in str(e.value)
    assert c.all_steps() == [1]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_1"]
    out = c.restore()
    assert np.array_equal(out["v4"], small["v4"])
    assert c.host_state() == {"rng": 1}
    c.save(3, small)  # the next save works
    assert c.all_steps() == [1, 3]


def test_ocdbt_group_is_an_int_and_only_in_format_ocdbt(rng):
  rejected(with_leaf(rng, 0, ocdbt_group=-1), "leaf 0", "ocdbt_group an int")
  rejected(with_leaf(rng, 0, ocdbt_group="../x"), "leaf 0", "ocdbt_group an int")
  doc = doc_of(make_index(rng))
  doc["leaves"][0]["ocdbt_group"] = 3
  doc["storage_format"] = "zarr3"
  rejected(pack(doc), "leaf 0", "no ocdbt_group (format zarr3)")
  doc["storage_format"] = "ocdbt"
  out = index.decode(pack(doc), WHERE)
  assert out.leaves[0].ocdbt_group == 3
  assert doc_of(out)["leaves"][0]["ocdbt_group"] == 3


class _HookCount:
  """What decode's container budget counts, by msgpack's own hooks."""

  def __init__(self):
    self.lists = self.maps = self.longest = 0

  def list_hook(self, x):
    self.lists += 1
    self.longest = max(self.longest, len(x))
    return x

  def object_hook(self, x):
    self.maps += 1
    self.longest = max(self.longest, len(x))
    return x


@pytest.mark.parametrize("state", [
    {"a": [1, (2, {"b": 3})], "c": None, "d": {}},
    7,
    [[[1]], (), {"x": {"y": [2, 3, 4, 5]}}],
    {f"k{i}": i for i in range(40)},
])
def test_encode_counts_containers_as_msgpack_does(rng, state):
  """encode counts the containers decode's budget limits on the python
  objects (no re-parsing): the same lists, maps and longest length as
  msgpack's hooks find in the bytes (a structure's lists its nodes)."""
  idx = make_index(rng)
  structure = tree.encode_structure(state)
  doc = {"structure": structure, "leaves": index_codec.encode(
      idx.leaves, index._KINDS_BY_CLASS), "m": {"k": [1, (2, 3)]}}
  count = _HookCount()
  sealed.unpackb(sealed.packb(doc, use_bin_type=True), raw=False,
                  list_hook=count.list_hook, object_hook=count.object_hook)
  n = len(tree.flatten(state))
  _, s_lists, s_longest = index._check_numbered_structure(structure, "", n)
  lists, maps, longest = index_codec.containers({**doc, "structure": None})
  assert (lists + s_lists, maps, max(longest, s_longest)) == (
      count.lists, count.maps, count.longest)


def test_encode_refuses_map_keys_decode_refuses(rng):
  idx = dataclasses.replace(make_index(rng), metrics={1: 2.0})
  _refused(idx, "would not decode", "not a string")
  idx = dataclasses.replace(make_index(rng), structure={
      "node": "dict", "keys": [], "children": [], 5: "x"})
  _refused(idx, "would be refused by readers", "a structure node (a list")


def test_encode_refuses_a_structure_that_does_not_number_its_leaves(rng):
  """The structure's leaf numbers must be the leaves, each once, each at
  the place tree.flatten names it (readers would refuse the rest, or
  rebuild a tree with its leaves in the wrong places)."""
  idx = make_index(rng)
  _refused(dataclasses.replace(idx, leaves=idx.leaves[:3]), "step 7",
           "would be refused by readers", "out of range: [3]")
  _refused(dataclasses.replace(idx, leaves=idx.leaves[::-1]),
           "has leaf 0 at 'params/b', where leaf 0 of the leaves is 'name'",
           "tree.flatten's order")
  names = [tree.path_str(e.path) for e in idx.leaves]
  _refused(dataclasses.replace(
      idx, structure=tree.named(idx.structure, names)),
           "a structure node (a list")


@pytest.mark.parametrize("count", [None, 0, 1, 3])
def test_host_states_round_trip(rng, count):
  """Version 5: how many processes' host_state files the step holds (0: a
  step saved without host_state); absent in older indexes (None)."""
  idx = dataclasses.replace(make_index(rng), host_states=count)
  doc = sealed.unpackb(index.encode(idx), raw=False)
  assert ("host_states" in doc) == (count is not None)
  assert index.decode(index.encode(idx)).host_states == count


# ---- held_by (version 6): never trusted --------------------------------------

def _held(rng, held, version=None):
  """The test index, its array params/w held by ``held``, as bytes."""
  doc = doc_of(make_index(rng))
  w = next(e for e in doc["leaves"] if e["path"] == ["params", "w"])
  w["held_by"] = held
  if version is not None:
    doc["version"] = version
  return pack(doc)


def test_held_by_round_trips(rng):
  idx = make_index(rng)
  leaves = tuple(dataclasses.replace(e, held_by=(3, "attempt-00ff"))
                 if getattr(e, "relpath", "") == "params/w" else e
                 for e in idx.leaves)
  got = index.decode(index.encode(dataclasses.replace(idx, leaves=leaves)))
  assert [getattr(e, "held_by", None) for e in got.leaves] == [
      None, (3, "attempt-00ff"), None, None]
  assert index.held_dir((3, "attempt-00ff")) == "checkpoint_3/attempt-00ff"
  assert index.decode(_held(rng, [6, "attempt-ab"])).leaves[1].held_by == (
      6, "attempt-ab")


@pytest.mark.parametrize("held", [
    [7, "attempt-ab"],            # its own step
    [8, "attempt-ab"],            # a later one
    [-1, "attempt-ab"],
    [True, "attempt-ab"],
    [1.0, "attempt-ab"],
    [1, "../x"],
    [1, "attempt-ab/../../x"],
    [1, "attempt-AB"],
    [1, ""],
    [1, "checkpoint_1"],
    [1],
    "checkpoint_1/attempt-ab",
    {"step": 1},
])
def test_held_by_refused(rng, held):
  rejected(_held(rng, held), "held_by")


def test_held_by_refused_before_version_6(rng):
  rejected(_held(rng, [1, "attempt-ab"], version=5), "held_by",
           "version 6")
