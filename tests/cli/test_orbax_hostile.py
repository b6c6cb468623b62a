"""``ckpt import`` of a hostile Orbax checkpoint (issue 34, item 7): each is
refused with an OrbaxImportError naming the file and the problem, before
anything is written, within a bound on CPU seconds (not wall time: a loaded
machine does not change the work a hostile input makes us do).

Each test edits a real Orbax item (written by orbax-checkpoint, zarr arrays
in directories) the way an attacker would. Before these checks: a
``.zarray`` of shape 2**40 with no chunk made the import write zeros until
the disk was full; a shape of 2**62 ended in MemoryError, 100,000-deep JSON
in RecursionError, a 2**40 x 2**40 mesh in ``std::bad_cast``; keys such as
``..`` reached TensorStore. Bucket sources: tests/objectstore/test_orbax_import.py.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time

import numpy as np
import pytest

import ckpt
from ckpt.cli import orbax_bounds
from ckpt.cli import orbax_tree
from tests.cli.test_cli import in_process

ocp = pytest.importorskip("orbax.checkpoint")

STATE = {"a": {"w": np.arange(1000, dtype=np.float32)},
         "b": np.ones(4, np.int32), "n": 3}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
  """An Orbax PyTree item with arrays in zarr directories (``a.w/``,
  ``b/``) and a scalar (``n``)."""
  path = tmp_path_factory.mktemp("orbax") / "item"
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as c:
    c.save(os.fspath(path), args=ocp.args.PyTreeSave(STATE))
  return path


@pytest.fixture
def item(clean, tmp_path):
  path = tmp_path / "src"
  shutil.copytree(clean, path)
  return path


def edit_json(path, fn):
  doc = json.loads(path.read_text())
  path.write_text(json.dumps(fn(doc) or doc))


def refused(capsys, src, dst, *more, cpu_s=2.0):
  """Runs ``ckpt import``; returns its one-line error after checking that
  it failed fast and wrote nothing."""
  t0 = time.process_time()
  rc, out, err = in_process(capsys, "import", src, dst, "--step", 1, *more)
  seconds = time.process_time() - t0
  print(f"refused in {seconds:.3f} CPU s: {err.strip()}")
  assert rc == 1 and seconds < cpu_s, (rc, seconds, out, err)
  assert len(err.splitlines()) == 1 and err.startswith("ckpt: error: "), err
  assert "unexpected" not in err and out == "", err  # one of ckpt's errors
  assert not dst.exists() or not any(dst.rglob("*.zarray")), "wrote data"
  return err


def test_the_clean_item_imports(item, tmp_path, capsys):
  rc, _, err = in_process(capsys, "import", item, tmp_path / "c", "--step", 1)
  assert rc == 0, err
  got = ckpt.load(tmp_path / "c")
  assert got["n"] == 3 and got["b"].tolist() == [1, 1, 1, 1]


def sparse(item, shape, chunks):
  """``b`` claims ``shape`` and stores no chunk; the item says missing
  chunks are fill values (as Orbax before store_array_data_equal_to_fill_value)."""
  edit_json(item / "_METADATA", lambda d: d.update(
      store_array_data_equal_to_fill_value=False))
  edit_json(item / "b" / ".zarray", lambda d: d.update(shape=shape,
                                                       chunks=chunks))
  for f in (item / "b").iterdir():
    if f.name != ".zarray":
      f.unlink()


def test_a_huge_array_with_no_chunks_is_refused_before_writing(
    item, tmp_path, capsys):
  """96 bytes of .zarray claiming 4 TiB: the import wrote zeros until the
  disk was full (37 GiB in 60 s)."""
  sparse(item, [2**40], [2**20])
  err = refused(capsys, item, tmp_path / "c")
  assert "claim 4398046" in err and "b/.zarray" in err, err
  assert "--allow-sparse" in err and "64x" in err, err
  with pytest.raises(ckpt.OrbaxImportError, match="leaf 'b'"):
    from ckpt.cli import convert  # pylint: disable=g-import-not-at-top
    convert.import_checkpoint(item, tmp_path / "c", 1)
  assert not (tmp_path / "c").exists()


def test_allow_sparse_imports_arrays_of_zeros(item, tmp_path, capsys,
                                              monkeypatch):
  """Over the bound (with no allowance): refused, unless --allow-sparse;
  then the missing chunks are zeros, as Orbax restores them."""
  monkeypatch.setattr(orbax_bounds, "SPARSE_ALLOWANCE", 0)
  sparse(item, [1 << 20], [1 << 18])
  err = refused(capsys, item, tmp_path / "c")
  assert "stores" in err and "--allow-sparse" in err, err
  rc, _, err = in_process(capsys, "import", item, tmp_path / "c", "--step", 1,
                          "--allow-sparse")
  assert rc == 0, err
  b = ckpt.load(tmp_path / "c")["b"]
  assert b.shape == (1 << 20,) and not b.any()


@pytest.mark.parametrize("keys", [[""], ["."], [".."], ["a/b"],
                                  [".", "/../../victim"], ["x", "..", "b"],
                                  ["\\..\\victim"], ["a\x00"]])
def test_keys_that_leave_their_directory_are_refused(item, tmp_path, capsys,
                                                     monkeypatch, keys):
  """Orbax names an array's directory by its keys joined with "."; keys
  [".", "/../../victim"] name ``../../../victim`` (on s3:// the HTTP layer
  resolves it: tests/objectstore/test_orbax_import.py). Refused before
  any array is opened."""
  def rekey(d):
    entry = d["tree_metadata"].pop("('b',)")
    entry["key_metadata"] = [{"key": k, "key_type": 2} for k in keys]
    d["tree_metadata"][repr(tuple(keys))] = entry
  edit_json(item / "_METADATA", rekey)
  opened = []
  real_open = orbax_tree.ts.open
  monkeypatch.setattr(orbax_tree.ts, "open",
                      lambda *a, **k: opened.append(a) or real_open(*a, **k))
  err = refused(capsys, item, tmp_path / "c")
  assert "_METADATA" in err and "is not a plain name" in err, err
  bad = next(k for k in keys
             if k in ("", ".", "..") or any(c in k for c in "/\\\x00"))
  assert repr(bad) in err, err
  assert opened == []


def test_an_item_name_that_leaves_the_step_is_refused(tmp_path, capsys):
  with ocp.CheckpointManager(os.fspath(tmp_path / "run")) as mgr:
    mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(
        {"w": np.ones(4, np.float32)})))
    mgr.wait_until_finished()
  step = tmp_path / "run" / "1"
  edit_json(step / "_CHECKPOINT_METADATA", lambda d: d.update(
      item_handlers={"../victim": d["item_handlers"]["state"]}))
  err = refused(capsys, step, tmp_path / "c")
  assert "item name '../victim'" in err and "_CHECKPOINT_METADATA" in err, err


@pytest.mark.parametrize("shape,chunks,fragment", [
    ([2**62], [2**20], "at most 1125899906842624"),   # was MemoryError
    ([2**40, 2**20], [1, 2**20], "at most 1125899906842624"),
    ([2**45], [2], "chunks"),
    ([4] * 65, [1] * 65, "Rank 65 is outside"),  # TensorStore's own limit
])
def test_shapes_out_of_bounds_are_refused(item, tmp_path, capsys, shape,
                                          chunks, fragment):
  edit_json(item / "b" / ".zarray", lambda d: d.update(shape=shape,
                                                       chunks=chunks))
  err = refused(capsys, item, tmp_path / "c")
  assert fragment in err and "leaf 'b'" in err and "b/.zarray" in err, err


def test_a_scalar_claiming_many_elements_is_refused(item, tmp_path, capsys):
  """A scalar is read whole: one of shape 2**40 would allocate 4 TiB."""
  edit_json(item / "n" / ".zarray", lambda d: d.update(shape=[2**40],
                                                       chunks=[2**20]))
  err = refused(capsys, item, tmp_path / "c")
  assert "leaf 'n'" in err and "n/.zarray" in err and "scalar" in err, err


@pytest.mark.parametrize("name", ["_METADATA", "_sharding", "_strings.json"])
def test_deep_json_is_refused(item, tmp_path, capsys, name):
  """100,000 nested arrays: RecursionError before."""
  (item / name).write_text("[" * 100_000 + "]" * 100_000)
  err = refused(capsys, item, tmp_path / "c")
  assert f"src/{name}" in err and "nested deeper" in err, err


def test_deep_json_item_is_refused(tmp_path, capsys):
  """A JSON item the parser reads (200 levels) but deeper than ckpt keeps."""
  with ocp.CheckpointManager(os.fspath(tmp_path / "run")) as mgr:
    mgr.save(1, args=ocp.args.Composite(extra=ocp.args.JsonSave({"a": 1})))
    mgr.wait_until_finished()
  step = tmp_path / "run" / "1"
  (f,) = [f for f in (step / "extra").iterdir() if f.suffix == ".json"] or [
      next(f for f in (step / "extra").iterdir()
           if f.name != "commit_success.txt")]
  f.write_text("[" * 200 + "]" * 200)
  err = refused(capsys, step, tmp_path / "c")
  assert "extra (JSON item)" in err and "deeper than 128" in err, err


def mesh_sharding(item, sizes, names, spec):
  edit_json(item / "_METADATA", lambda d: d["tree_metadata"]["('b',)"][
      "value_metadata"].update(value_type="jax.Array"))
  name = base64.urlsafe_b64encode(b"b").decode()
  (item / "_sharding").write_text(json.dumps({name: json.dumps({
      "sharding_type": "NamedSharding", "shape": sizes, "axis_names": names,
      "partition_spec": spec})}))


@pytest.mark.parametrize("sizes,names,spec", [
    ([2**40, 2**40], ["x", "y"], ["x"]),        # std::bad_cast before
    ([2, 2], ["x", "x"], ["x"]),                 # one name twice
    ([2] * 17, [f"a{i}" for i in range(17)], []),
    ([2], ["x"], ["x", None]),                   # longer than the rank
])
def test_meshes_out_of_bounds_are_refused(item, tmp_path, capsys, sizes,
                                          names, spec):
  mesh_sharding(item, sizes, names, spec)
  err = refused(capsys, item, tmp_path / "c")
  assert "leaf 'b'" in err and "src/_sharding" in err, err


class _Sizes:
  """A bucket's objects by size, answering sizes_at_least as a Storage."""

  def __init__(self, sizes):
    self.sizes, self.asked = sizes, 0

  def sizes_at_least(self, keys, size):
    self.asked += len(keys)
    return [self.sizes[k] >= size for k in keys]


@pytest.mark.parametrize("sizes,need,found", [
    # A fresh Adam state: one object of weights, two of zeros (tiny).
    ({"p": 3000, "mu": 20, "nu": 20}, 2000, True),
    ({"p": 3000, "mu": 20, "nu": 20}, 3041, False),
    ({f"k{i}": 100 for i in range(1000)}, 100_000, True),
    ({}, 1, False),
])
def test_the_lower_bound_on_bytes_in_a_bucket(sizes, need, found):
  fake = _Sizes(sizes)
  bound = orbax_bounds.lower_bound(fake, list(sizes), need)
  assert (bound >= need) == found and bound <= sum(sizes.values())
  assert fake.asked <= 3 * len(sizes), fake.asked
