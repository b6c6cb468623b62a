"""Packed small leaves (ckpt/save/pack.py, ckpt/restore/pack_read.py): written into one
object per process with its table, read back onto any mesh, partially,
lazily, verified, and refused when a table or pack is hostile.

Real TensorStore on the local disk, 8 CPU devices (tests/conftest.py);
the multi-process case is tests/multiprocess/test_sharded.py (2 processes
pack, 4 and 1 restore onto other meshes) and the object-store case
tests/objectstore/test_pack_s3.py.
"""

from __future__ import annotations

import pathlib
import threading

import jax
import jax.numpy as jnp
import msgpack
from tests import sealed
from ckpt.format import seal
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.format import index as index_lib
from ckpt.format import index_codec
from ckpt.cli import integrity
from ckpt.save import pack
from ckpt.format import pack_index
from ckpt.format import pack_table
from ckpt.restore import pack_leaf
from ckpt.restore import pack_read
from ckpt.errors import CorruptCheckpointError
from ckpt.format import entries


def _mesh(shape=(2, 4), axes=("data", "model")):
  return jax.make_mesh(shape, axes)


def make_state():
  mesh = _mesh()
  rng = np.random.default_rng(0)

  def put(x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))

  return {
      "w": put(rng.standard_normal((64, 16), dtype=np.float32), "model"),
      "r": put(rng.standard_normal((24, 32), dtype=np.float32)),
      "b16": put(rng.standard_normal((32, 32)).astype(jnp.bfloat16), None,
                 ("data", "model")),
      "i": put(rng.integers(0, 100, (40, 8), dtype=np.int32), "data"),
      "keys": jax.device_put(jax.random.split(jax.random.key(1), 16),
                             NamedSharding(mesh, P("model"))),
      # 64 KiB + 4 bytes: over MAX_LEAF_BYTES, a TensorStore array.
      "big": put(rng.standard_normal((16385,), dtype=np.float32)),
      "host": rng.standard_normal((50, 3)),
      "n": 7,
  }


ARRAYS = ("w", "r", "b16", "i", "big", "host")
PACKED = ("w", "r", "b16", "i", "keys", "host")


def _step(root) -> pathlib.Path:
  return pathlib.Path(root) / "checkpoint_1"


@pytest.fixture
def saved(tmp_path):
  state = make_state()
  root = str(tmp_path / "ck")
  with ckpt.Checkpointer(root, async_save=False) as c:
    c.save(1, state)
  return root, state


def _equal(got, want) -> bool:
  return np.array_equal(np.asarray(got), np.asarray(want))


def test_small_leaves_are_packed_large_ones_arrays(saved):
  root, _ = saved
  step = _step(root)
  for name in PACKED:
    assert not (step / name).exists(), name
  assert (step / "big" / ".zarray").is_file()
  assert sorted(p.name for p in (step / ".packs").iterdir()) == [
      "0.0.bin", "0.msgpack"]
  index = index_lib.decode((step / "index.msgpack").read_bytes())
  assert index_lib.VERSION >= 2  # packed leaves since version 2
  kinds = {"/".join(e.path): type(e).__name__ for e in index.leaves}
  assert {kinds[n] for n in PACKED} == {"PackedEntry"}
  assert kinds["big"] == "ArrayEntry" and kinds["n"] == "ValueEntry"
  table, rows = _table(root)
  assert table["version"] == pack_table.VERSION == 2  # columns
  # w: 4 distinct boxes (model), r: 1, b16: 8, i: 2, keys: 4, host: 1.
  assert len(rows) == 4 + 1 + 8 + 2 + 4 + 1
  assert table["packs"] == [(step / ".packs" / "0.0.bin").stat().st_size]


def test_restore_onto_another_mesh_bit_exact(saved):
  root, state = saved
  mesh = _mesh((4, 2), ("a", "b"))
  specs = {"w": P(None, "b"), "r": P("a", "b"), "b16": P("b"),
           "i": P(("a", "b")), "big": P(), "keys": P("a")}
  target = {k: (jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
      mesh, specs[k])) if k in specs else v) for k, v in state.items()}
  with ckpt.Checkpointer(root) as c:
    got = c.restore(1, target=target)
  for k in specs:
    assert got[k].sharding.spec == specs[k], k
  for k in ARRAYS:
    assert _equal(got[k], state[k]), k
  assert _equal(jax.random.key_data(got["keys"]),
                jax.random.key_data(state["keys"]))
  assert got["n"] == 7
  # No target: numpy values as saved, keys as keys.
  loaded = ckpt.load(root)
  for k in ARRAYS:
    assert _equal(loaded[k], state[k]), k


def test_restore_dtype_cast_and_transform(saved):
  root, state = saved
  target = {"w": jax.ShapeDtypeStruct((64, 16), jnp.bfloat16),
            "r2": jax.ShapeDtypeStruct((24, 32), jnp.float32)}

  def rename(tree, target_tree, is_resuming=False):
    del target_tree, is_resuming
    return {"w": tree["w"], "r2": tree["r"]}

  with ckpt.Checkpointer(root) as c:
    got = c.restore(1, target=target, transforms=[rename])
  assert got["w"].dtype == jnp.bfloat16
  assert _equal(got["w"], np.asarray(state["w"]).astype(jnp.bfloat16))
  assert _equal(got["r2"], state["r"])


def test_partial_restore_reads_only_the_needed_ranges(saved, monkeypatch):
  root, state = saved
  ranges = []
  real = pack_read.PackSet._range

  def spy(self, kv, p, k, a, b):
    ranges.append((p, k, a, b))
    return real(self, kv, p, k, a, b)

  monkeypatch.setattr(pack_read, "_MERGE_GAP", 0)
  monkeypatch.setattr(pack_read.PackSet, "_range", spy)
  with ckpt.Checkpointer(root) as c:
    got = c.restore(1, target={"i": jax.ShapeDtypeStruct((40, 8), jnp.int32)})
  assert _equal(got["i"], state["i"])
  size = (_step(root) / ".packs" / "0.0.bin").stat().st_size
  assert ranges and all(a < b for _, _, a, b in ranges)
  read = sum(b - a for _, _, a, b in ranges)
  assert read == 40 * 8 * 4 < size, (ranges, size)


def test_lazy_leaves(saved):
  root, state = saved
  with ckpt.Checkpointer(root) as c:
    lz = c.restore(1, lazy=True)
    assert isinstance(lz["w"], pack_leaf.LazyPacked)
    assert _equal(lz["w"].read(), state["w"])
    sharding = NamedSharding(_mesh(), P("data", "model"))
    placed = lz["w"].read(sharding=sharding)
    assert placed.sharding == sharding and _equal(placed, state["w"])
    assert _equal(jax.random.key_data(lz["keys"].read()),
                  jax.random.key_data(state["keys"]))


def _flip(path: pathlib.Path, at: int) -> None:
  data = bytearray(path.read_bytes())
  data[at] ^= 0x10
  path.write_bytes(bytes(data))


def _table(root) -> tuple[dict, list[list]]:
  """Process 0's pack table and its pieces as rows."""
  step = _step(root)
  index = index_lib.decode((step / "index.msgpack").read_bytes())
  table = sealed.unpackb((step / ".packs" / "0.msgpack").read_bytes())
  return table, pack_table.rows(table, index.leaves)


def _piece_of(root, leaf: str):
  step = _step(root)
  index = index_lib.decode((step / "index.msgpack").read_bytes())
  pos = [i for i, e in enumerate(index.leaves) if "/".join(e.path) == leaf][0]
  return pos, [p for p in _table(root)[1] if p[0] == pos]


def test_flipped_byte_is_caught_naming_the_leaf(saved):
  root, _ = saved
  _, pieces = _piece_of(root, "i")
  _flip(_step(root) / ".packs" / "0.0.bin", pieces[0][2] + 5)
  problems = integrity.verify(root)
  assert [p.path for p in problems] == ["i"]
  assert "crc32c" in problems[0].message
  with ckpt.Checkpointer(root) as c:
    with pytest.raises(CorruptCheckpointError, match="leaf 'i'.*crc32c"):
      c.restore(1, verify=True)
    # Every read checks: a plain restore fails too, naming the leaf.
    with pytest.raises(CorruptCheckpointError, match="leaf 'i'"):
      c.restore(1)
    # Leaves that do not touch the bad box still read.
    got = c.restore(1, target={"r": jax.ShapeDtypeStruct((24, 32),
                                                         jnp.float32)})
    assert got["r"].shape == (24, 32)


def _edit_table(root, fn, version: int = 2) -> None:
  """Edits process 0's table as rows (``fn(doc)``, doc["pieces"] the
  rows) and writes it back as a table of ``version`` (1: rows, as index
  version 2 wrote them; 2: columns)."""
  path = _step(root) / ".packs" / "0.msgpack"
  table, rows = _table(root)
  doc = {"process": table["process"], "packs": table["packs"],
         "pieces": rows}
  fn(doc)
  if version == 2 and set(doc) == {"process", "packs", "pieces"}:
    doc = pack_table.with_rows(doc, doc["pieces"])
  path.write_bytes(sealed.packb(doc))


def _hostile(doc, pos, what, version):
  piece = next(p for p in doc["pieces"] if p[0] == pos)
  if what == "offset_past_pack":
    piece[2] = doc["packs"][0] - 4
  elif what == "negative_offset":  # columns are unsigned: it wraps
    piece[2] = -64 if version == 1 else 2**64 - 64
  elif what == "box_outside":
    piece[4] = [piece[4][0] + 1000] + piece[4][1:]
  elif what == "rank":
    piece[3], piece[4] = piece[3] + [0], piece[4] + [1]
  elif what == "pack_number":
    piece[1] = 7
  elif what == "duplicate":
    doc["pieces"].append(list(piece))
  elif what == "dropped":
    doc["pieces"].remove(piece)
  elif what == "crc":  # (a column of uint32 cannot hold it)
    piece[5] = 2**40


_ENTRY_EDITS = ["offset_past_pack", "negative_offset", "box_outside", "rank",
                "pack_number", "duplicate", "dropped"]


# (a uint32 column cannot hold an out-of-range crc32c: rows only)
@pytest.mark.parametrize("what,version", [
    *((w, v) for v in (1, 2) for w in _ENTRY_EDITS), ("crc", 1)])
def test_hostile_table_entries_name_the_leaf(saved, what, version):
  root, _ = saved
  pos, _ = _piece_of(root, "w")
  _edit_table(root, lambda doc: _hostile(doc, pos, what, version), version)
  # (in columns an extra dimension is a box column of the wrong length,
  # which no one piece owns: the table is named)
  match = ("pack table .*column box" if (what, version) == ("rank", 2)
           else "'w'")
  with ckpt.Checkpointer(root) as c:
    with pytest.raises(CorruptCheckpointError, match=match):
      c.restore(1)


_TABLE_EDITS = ["process", "leaf_not_packed", "leaf_range", "not_a_map",
                "pack_size"]


@pytest.mark.parametrize("what,version", [
    *((w, v) for v in (1, 2) for w in _TABLE_EDITS),
    *((w, 2) for w in ("columns", "box_bytes", "table_version"))])
def test_hostile_table_is_refused(saved, what, version):
  root, _ = saved

  def edit(doc):
    if what == "process":
      doc["process"] = 3
    elif what == "leaf_not_packed":  # "big" is an array, "n" inline
      index = index_lib.decode(
          (_step(root) / "index.msgpack").read_bytes())
      big = [i for i, e in enumerate(index.leaves) if e.path == ("big",)][0]
      doc["pieces"][0][0] = big
    elif what == "leaf_range":
      doc["pieces"][0][0] = 10**6
    elif what == "pack_size":
      doc["packs"] = [2**40]
    elif what in ("columns", "box_bytes", "table_version"):
      cols = pack_table.with_rows(doc, doc["pieces"])
      doc.clear()
      doc.update(cols)
      if what == "columns":  # one column a piece short
        doc["crc"] = doc["crc"][:-4]
      elif what == "box_bytes":
        doc["box"] = doc["box"][:-8]
      else:
        doc["version"] = 3
    else:
      doc.clear()

  if what == "not_a_map":
    (_step(root) / ".packs" / "0.msgpack").write_bytes(seal.seal(msgpack.packb([1, 2])))
  else:
    _edit_table(root, edit, version)
  with ckpt.Checkpointer(root) as c:
    with pytest.raises(CorruptCheckpointError, match="pack table"):
      c.restore(1)


def test_truncated_or_missing_pack_names_the_leaf(saved):
  root, _ = saved
  path = _step(root) / ".packs" / "0.0.bin"
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])
  with ckpt.Checkpointer(root) as c:
    with pytest.raises(CorruptCheckpointError, match="pack"):
      c.restore(1)
  path.unlink()
  with ckpt.Checkpointer(root) as c:
    with pytest.raises(CorruptCheckpointError, match="missing"):
      c.restore(1)


def test_missing_table_leaves_leaves_uncovered(saved):
  root, _ = saved
  (_step(root) / ".packs" / "0.msgpack").unlink()
  with ckpt.Checkpointer(root) as c:
    with pytest.raises(CorruptCheckpointError,
                       match="leaf '.*'.*do not cover it exactly once"):
      c.restore(1)


def _entry(**over):
  doc = {"path": ["x"], "kind": "packed", "shape": [4, 4], "dtype": "float32",
         "source_dtype": "float32", "sharding": ""}
  doc.update(over)
  return doc


def _index_doc(entry, version=2):
  return {"format": "ckpt", "version": version, "step": 1, "time": 0.0,
          "storage_format": "zarr", "process_count": 1, "metrics": {},
          "structure": (["dict", "x", 0] if version >= 3 else
                        {"node": "dict", "keys": ["x"],
                         "children": [{"leaf": "x"}]}),
          "leaves": ([entry] if version == 1 else
                     index_codec.columns([entry], entries.KINDS)),
          "host_state": None}


def test_packed_entry_round_trips_and_hostile_entries_are_refused():
  e = pack_index.PackedEntry(("x",), (4, 4), "float32", "float32")
  doc = e.to_json()
  assert doc["kind"] == "packed" and "relpath" not in doc
  got = index_lib.decode(sealed.packb(_index_doc(doc), use_bin_type=True))
  assert got.leaves == (e,)
  for bad in (_entry(shape=[-1]), _entry(dtype="object"),
              _entry(shape=[1 << 40, 1 << 20]), _entry(shape=[4096, 4097]),
              _entry(sharding=3),
              _entry(prng_impl="nope")):
    with pytest.raises(CorruptCheckpointError, match=r"leaf 0 \(x\)"):
      index_lib.decode(sealed.packb(_index_doc(bad), use_bin_type=True))
  # Version 1 indexes have no packed leaves.
  with pytest.raises(CorruptCheckpointError, match="kind 'array' or 'value'"):
    index_lib.decode(sealed.packb(_index_doc(_entry(), 1),
                                   use_bin_type=True))
  with pytest.raises(CorruptCheckpointError,
                     match="version 1 or 2 or 3 or 4 or 5 or 6"):
    index_lib.decode(sealed.packb(_index_doc(_entry(), 7),
                                   use_bin_type=True))
  # Version 3: the same leaf, its place in the structure by number.
  got = index_lib.decode(sealed.packb(_index_doc(doc, 3), use_bin_type=True))
  assert got.leaves == (e,) and got.structure == ["dict", "x", 0]


def test_names_are_built_from_checked_ints():
  assert pack_index.pack_name(3, 1) == ".packs/3.1.bin"
  assert pack_index.table_name(0) == ".packs/0.msgpack"
  for bad in (-1, "0", 1 << 20, True):
    with pytest.raises(CorruptCheckpointError):
      pack_index.pack_name(bad, 0)


@pytest.mark.parametrize("fmt", ["zarr3", "ocdbt"])
def test_other_formats_and_several_packs(tmp_path, monkeypatch, fmt):
  # A pack holds at most MAX_PACK_OBJECT_BYTES: three leaves, three packs.
  monkeypatch.setattr(pack, "MAX_PACK_OBJECT_BYTES", 4096)
  state = {f"l{i}": np.full((1000,), i, np.float32) for i in range(3)}
  root = str(tmp_path / fmt)
  with ckpt.Checkpointer(root, async_save=False, format=fmt) as c:
    c.save(1, state)
    stats = c.last_save_stats
  assert stats.bytes_written == 3 * 4000 and stats.boxes_written == 3
  names = sorted(p.name for p in (_step(root) / ".packs").iterdir())
  assert names == ["0.0.bin", "0.1.bin", "0.2.bin", "0.msgpack"]
  got = ckpt.load(root)
  for k, v in state.items():
    assert _equal(got[k], v), k
  assert integrity.verify(root) == []


def test_async_save_packs_and_caller_may_delete(tmp_path):
  state = make_state()
  root = str(tmp_path / "async")
  with ckpt.Checkpointer(root, async_save=True) as c:
    c.save(1, state)
    want = {k: np.asarray(state[k]) for k in ARRAYS}
    for k in ("w", "r", "i"):
      state[k].delete()
    c.wait_until_finished()
  got = ckpt.load(root)
  for k in ARRAYS:
    assert _equal(got[k], want[k]), k


@pytest.mark.parametrize("budget", [None, 8192])
def test_async_packs_are_joined_after_save_returns(tmp_path, monkeypatch,
                                                   budget):
  """Packs are joined and summed after save() returns: a jax array's boxes
  are views that outlive its delete, a host numpy leaf was copied before
  save() returned (the caller may overwrite it); with a budget smaller than
  the packs (four of them), staging writes the packs staged so far to free
  it instead of waiting for them forever."""
  monkeypatch.setattr(pack, "MAX_PACK_OBJECT_BYTES", 4096)
  changed = threading.Event()
  join = pack.PackWriter._join  # pylint: disable=protected-access

  def join_once_changed(self, *args):
    if budget is None:  # (with the small budget some join while staging)
      assert changed.wait(60)
    return join(self, *args)

  monkeypatch.setattr(pack.PackWriter, "_join", join_once_changed)
  state = make_state()
  want = {k: np.array(state[k]) for k in ARRAYS}
  root = str(tmp_path / "async")
  with ckpt.Checkpointer(root, async_save=True,
                         concurrent_bytes=budget or (1 << 30)) as c:
    c.save(1, state)
    state["host"][:] = -1.0
    for k in ("w", "r", "i"):
      state[k].delete()
    changed.set()
    c.wait_until_finished()
  assert len(list((_step(root) / ".packs").iterdir())) > 3
  got = ckpt.load(root)
  for k in ARRAYS:
    assert _equal(got[k], want[k]), k
  assert integrity.verify(root) == []


def test_pack_threshold_zero_stores_arrays(tmp_path, monkeypatch):
  monkeypatch.setattr(pack, "MAX_LEAF_BYTES", 0)
  root = str(tmp_path / "nopack")
  state = make_state()
  with ckpt.Checkpointer(root, async_save=False) as c:
    c.save(1, state)
  assert not (_step(root) / ".packs").exists()
  assert (_step(root) / "w" / ".zarray").is_file()
  assert _equal(ckpt.load(root)["w"], state["w"])


def test_packs_are_durable_before_the_commit_rename(tmp_path, monkeypatch):
  """The pack objects are written by TensorStore's file driver (which
  fsyncs them); their directory is fsynced with the step's before the
  rename that commits it (ckpt/commit/protocol.py)."""
  import os  # pylint: disable=g-import-not-at-top
  from tests.conftest import record_fsync_and_rename  # pylint: disable=g-import-not-at-top
  root = os.path.realpath(tmp_path / "dur")
  calls = record_fsync_and_rename(monkeypatch)
  with ckpt.Checkpointer(root, async_save=False) as c:
    c.save(1, {"w": np.arange(1000, dtype=np.float32)})
  monkeypatch.undo()
  [commit] = [i for i, x in enumerate(calls) if x[0] == "rename"
              and x[2] == os.path.join(root, "checkpoint_1")]
  work = calls[commit][1]
  before = {x[1] for x in calls[:commit] if x[0] == "fsync"}
  assert os.path.join(work, ".packs") in before, calls
  assert os.path.isfile(os.path.join(root, "checkpoint_1", ".packs", "0.0.bin"))


def test_cli_inspect_verify_and_export_packed_leaves(saved, capsys, tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  from ckpt.cli import main as cli  # pylint: disable=g-import-not-at-top
  root, state = saved
  assert cli.main(["inspect", root, "--json"]) == 0
  doc = json.loads(capsys.readouterr().out)
  leaves = {x["path"]: x for x in doc["leaves"]}
  assert leaves["w"]["kind"] == "packed" and leaves["w"]["shape"] == [64, 16]
  assert leaves["w"]["bytes"] == 64 * 16 * 4 and leaves["big"]["kind"] == "array"
  assert doc["array_bytes"] == sum(np.asarray(state[k]).nbytes
                                   for k in ARRAYS) + 16 * 2 * 4  # + keys
  assert cli.main(["inspect", root]) == 0
  row = next(line for line in capsys.readouterr().out.splitlines()
             if line.startswith("w "))
  assert "packed" in row and "crc32c" in row
  assert cli.main(["verify", root, "--json"]) == 0
  doc = json.loads(capsys.readouterr().out)
  assert doc["ok"] and doc["arrays"] == len(ARRAYS) + 1  # + the keys
  out = tmp_path / "x.npz"
  assert cli.main(["export", root, str(out), "--to", "npz", "-q"]) == 0
  capsys.readouterr()
  with np.load(out) as z:
    assert np.array_equal(z["w"], np.asarray(state["w"]))
