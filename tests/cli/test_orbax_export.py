"""``ckpt export --to orbax`` (ckpt/cli/orbax_export.py): Orbax itself
(orbax-checkpoint from the test extra) restores the export bit-exact, onto
the saved shardings, with ``StandardCheckpointer`` and ``CheckpointManager``;
arrays are copied within the byte budget; ``ckpt import`` reads the export
back (the door opens both ways)."""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest

import ckpt
from ckpt.cli import convert
from ckpt.cli import orbax_layout
from ckpt.shards.plan import Box
from tests.cli.test_cli import assert_one_line_error, in_process, same
from tests.conftest import mesh, named, sharded

ocp = pytest.importorskip("orbax.checkpoint")

STEP = 12
BUDGET = 4096  # bytes in flight: far below the state's size


def _state():
  rng = np.random.default_rng(3)
  m = mesh((2, 4), ("data", "model"))
  return {
      "params": {
          # stored arrays of several chunks (chunk_bytes below), sharded
          "w": sharded(rng.standard_normal((64, 32)).astype(np.float32),
                       named(m, "data", "model")),
          "emb": sharded(rng.standard_normal((128, 16)).astype(
              ml_dtypes.bfloat16), named(m, None, "model")),
          # small: packed, and kept inline
          "b": sharded(rng.standard_normal(8).astype(np.float32),
                       named(m, "model")),
          "scale": sharded(np.float32(2.5) + np.zeros((), np.float32),
                           named(m)),
      },
      "layers": [sharded(rng.integers(-9, 9, (16, 8)).astype(np.int32),
                         named(m, ("data", "model")))],
      "host": rng.standard_normal((40, 30)),          # numpy float64
      "ids": np.arange(6, dtype=np.int16).reshape(2, 3),
      "step": 41, "lr": 0.125, "done": False,
      "rng": jax.random.key(9),                        # a typed PRNG key
  }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  root = tmp_path_factory.mktemp("ckpt") / "run"
  state = _state()
  with ckpt.Checkpointer(root, chunk_bytes=1024) as c:
    c.save(STEP, state, metrics={"loss": 0.5, "eval/acc": 0.75},
           custom_metadata={"run": "a"})
  return root, state


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):
  root, _ = saved
  out = tmp_path_factory.mktemp("orbax") / "run"
  report = ckpt.export_orbax(root, out, concurrent_bytes=BUDGET)
  return out, report


def _assert_bit_exact(got, want):
  got_flat = jax.tree_util.tree_flatten_with_path(got)[0]
  want_flat = jax.tree_util.tree_flatten_with_path(want)[0]
  assert [p for p, _ in got_flat] == [p for p, _ in want_flat]
  for (path, g), (_, w) in zip(got_flat, want_flat):
    name = jax.tree_util.keystr(path)
    assert type(g) is type(w) or (isinstance(g, jax.Array) and
                                  isinstance(w, jax.Array)), (name, g, w)
    if isinstance(w, jax.Array):
      assert g.sharding == w.sharding, (name, g.sharding, w.sharding)
      if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        g, w = jax.random.key_data(g), jax.random.key_data(w)
    assert same(g, w), (name, g, w)


def test_standard_checkpointer_restores_bit_exact(exported, saved):
  out, report = exported
  _, state = saved
  assert report.item_dir == f"{out}/{STEP}/default"
  got = ocp.StandardCheckpointer().restore(report.item_dir, state)
  _assert_bit_exact(got, state)


def test_checkpoint_manager_restores_bit_exact(exported, saved):
  out, _ = exported
  _, state = saved
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array) else x, state)
  with ocp.CheckpointManager(os.fspath(out)) as mgr:
    assert mgr.all_steps() == [STEP]
    got = mgr.restore(STEP, args=ocp.args.StandardRestore(target))
    meta = mgr.item_metadata(STEP)
  _assert_bit_exact(got, state)
  assert meta is not None


def test_budget_and_report(exported, saved):
  out, report = exported
  _, state = saved
  arrays = [x for x in jax.tree.leaves(state) if hasattr(x, "nbytes") and
            not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
  assert report.bytes >= sum(np.asarray(x).nbytes for x in arrays) > 4 * BUDGET
  assert 0 < report.peak_bytes <= BUDGET
  assert report.metrics
  step_dir = out / str(STEP)
  meta = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
  assert meta["metrics"] == {"loss": 0.5, "eval/acc": 0.75}
  assert meta["custom_metadata"] == {"run": "a"}
  assert not [p for p in out.iterdir() if p.name != str(STEP)]  # no tmp left


def test_import_reads_the_export_back(exported, saved, tmp_path):
  out, _ = exported
  _, state = saved
  # (ckpt import refuses an Orbax step's custom_metadata unless skipped)
  report = convert.import_checkpoint(out / str(STEP), tmp_path / "back", STEP,
                                     skip=["custom_metadata"])
  assert report.items == {"default": "pytree", "metrics": "metrics"}
  got = ckpt.load(tmp_path / "back")
  for path, want in jax.tree_util.tree_flatten_with_path(state)[0]:
    node = got
    for k in path:
      node = node[getattr(k, "key", getattr(k, "idx", None))]
    if isinstance(want, jax.Array) and jax.dtypes.issubdtype(
        want.dtype, jax.dtypes.prng_key):
      assert node.dtype == want.dtype, path
      node, want = jax.random.key_data(node), jax.random.key_data(want)
    assert same(node, want), path
  with ckpt.Checkpointer(tmp_path / "back") as c:
    assert c.metrics(STEP) == {"loss": 0.5, "eval/acc": 0.75}


def test_cli_export_to_orbax(saved, tmp_path, capsys):
  root, state = saved
  out = tmp_path / "orbax"
  rc, stdout, err = in_process(capsys, "export", root, out, "--to", "orbax",
                               "--concurrent-bytes", "64K", "--json")
  assert rc == 0, err
  doc = json.loads(stdout)
  assert doc["step"] == STEP and doc["item_dir"] == f"{out}/{STEP}/default"
  got = ocp.StandardCheckpointer().restore(doc["item_dir"], state)
  _assert_bit_exact(got, state)
  # the step exists now: refused, nothing touched
  rc, stdout, err = in_process(capsys, "export", root, out, "--to", "orbax")
  assert_one_line_error(rc, stdout, err, f"{out}/{STEP} exists already")


def test_strings_and_empty_nodes_as_orbax_writes_them(tmp_path):
  """StandardCheckpointer refuses str leaves; PyTreeCheckpointer restores
  them, and the empty nodes, with no target."""
  state = {"name": "run-1", "empty": {}, "nothing": None, "seq": [],
           "x": np.arange(4, dtype=np.uint8)}
  with ckpt.Checkpointer(tmp_path / "r") as c:
    c.save(3, state)
  report = ckpt.export_orbax(tmp_path / "r", tmp_path / "o")
  assert (report.arrays, report.values) == (1, 4)
  got = ocp.PyTreeCheckpointer().restore(report.item_dir)
  assert got["name"] == "run-1" and got["empty"] == {} and got["seq"] == []
  assert got["nothing"] is None and same(got["x"], state["x"])


def test_refuses_what_orbax_cannot_hold(tmp_path):
  with ckpt.Checkpointer(tmp_path / "r") as c:
    c.save(1, {"a.b": np.ones(3), "a": {"b": np.zeros(3)}})
  with pytest.raises(convert.ConvertError,
                     match=r"leaves 'a/b' and 'a\.b' have the same Orbax "
                     r"parameter name 'a\.b'"):
    ckpt.export_orbax(tmp_path / "r", tmp_path / "o")
  assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def test_boxes_are_whole_chunks_within_the_budget():
  # rows of chunks while they fit
  assert orbax_layout.boxes((10, 4), (3, 4), 4, 100) == [
      Box((0, 0), (6, 4)), Box((6, 0), (10, 4))]
  # one row of chunks is over the budget: chunk by chunk
  assert orbax_layout.boxes((4, 4), (2, 2), 4, 20) == [
      Box((0, 0), (2, 2)), Box((0, 2), (2, 4)), Box((2, 0), (4, 2)),
      Box((2, 2), (4, 4))]
  assert orbax_layout.boxes((), (), 4, 1) == [Box((), ())]
  assert orbax_layout.boxes((0, 5), (1, 5), 4, 100) == []
