"""``ckpt import`` of an Orbax step's per-process items (Grain's
``process_<i>-of-<n>.json`` files, JSON items named per process) as each
process's ``host_state``, read back by a real 2-process job; and one meaning
for a step without per-process state: None on any number of processes."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

import ckpt
from ckpt.cli import orbax_import
from ckpt.errors import OrbaxImportError
from ckpt.multihost import local_cluster
from tests.cli import host_state_worker
from tests.cli.test_cli import assert_one_line_error, in_process, json_in_process
from tests.multiprocess import worker

ocp = pytest.importorskip("orbax.checkpoint")

REPO = pathlib.Path(__file__).resolve().parents[2]
GRAIN_HANDLER = "grain._src.python.checkpoint_handlers.PyGrainCheckpointHandler"


def grain_state(i: int) -> dict:
  """What Grain's iterator writes for process i (get_state(), JSON)."""
  return {"version": 2, "last_seen_indices": {"0": 40 + i},
          "last_worker_index": -1, "worker_count": 0,
          "sampler": f"IndexSampler(shard_index={i}, shard_count=2)"}


def orbax_step(root, step, **items):
  with ocp.CheckpointManager(os.fspath(root)) as mgr:
    mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"w": np.arange(8, dtype=np.float32)}),
        **items))
    mgr.wait_until_finished()
  return pathlib.Path(root) / str(step)


def add_grain_item(src, name="data_iter", states=None, files=None):
  """Grain's layout, written as PyGrainCheckpointHandler writes it: one
  ``process_<i>-of-<n>.json`` per process in the item's directory, and the
  handler in the step's ``_CHECKPOINT_METADATA``."""
  states = states if states is not None else [grain_state(i) for i in (0, 1)]
  n = len(states)
  item = src / name
  item.mkdir()
  for i, s in enumerate(states):
    if files is None or i in files:
      (item / f"process_{i}-of-{n}.json").write_text(json.dumps(s, indent=4))
  (item / "commit_success.txt").write_text("done")  # not data
  meta = json.loads((src / "_CHECKPOINT_METADATA").read_text())
  meta["item_handlers"][name] = GRAIN_HANDLER
  (src / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))


def per_process_json(n=2, name="rng"):
  return {f"{name}_process_{i}-of-{n}": ocp.args.JsonSave({"seed": 100 + i})
          for i in range(n)}


def test_per_process_items_become_each_process_host_state(tmp_path, capsys):
  grain = orbax_step(tmp_path / "grain", 1, extra=ocp.args.JsonSave({"a": 1}))
  add_grain_item(grain)
  named = orbax_step(tmp_path / "named", 2, **per_process_json())
  plain = orbax_step(tmp_path / "plain", 3)
  dst = tmp_path / "c"
  doc = json_in_process(capsys, "import", grain, dst, "--step", 1)
  assert doc["items"] == {"data_iter": "host_state", "extra": "json",
                          "state": "pytree"}
  assert doc["host_state_processes"] == 2
  doc = json_in_process(capsys, "import", named, dst, "--step", 2)
  assert doc["items"]["rng_process_1-of-2"] == "host_state"
  doc = json_in_process(capsys, "import", plain, dst, "--step", 3)
  assert doc["host_state_processes"] == 0
  assert ckpt.load(dst, 1)["extra"] == {"a": 1}
  with ckpt.Checkpointer(dst, async_save=False) as c:
    c.save(4, {"x": np.float32(4)})                     # native, none
    c.save(5, {"x": np.float32(5)}, host_state={"me": 0})
    # This job has 1 process: the imported steps hold 2 processes' state.
    for s in (1, 2):
      with pytest.raises(ckpt.CheckpointError,
                         match="holds host_state for 2 processes but this "
                               "job has 1"):
        c.host_state(s)
    assert c.host_state(3) is None and c.host_state(4) is None
    assert c.host_state(5) == {"me": 0}
  results = [worker.decode(host_state_worker.Result, r)
             for r in local_cluster.check(local_cluster.run(
                 "tests.cli.host_state_worker",
                 {"src": os.fspath(grain), "dir": os.fspath(dst),
                  "steps": [1, 2, 3, 4, 5], "timeout": 60},
                 num_processes=2, devices_per_process=1, timeout_s=120,
                 cwd=str(REPO)))]
  for pid, r in enumerate(results):
    got = r.host_states
    assert r.imported == 2

    def value(s, got=got):
      assert got[s].ok, got[s]
      return got[s].value
    for s in ("1", "10"):  # imported by 1 process, and by this 2-process job
      assert value(s) == grain_state(pid), (pid, s)
    assert value("2") == {"seed": 100 + pid}
    assert value("11") == {"me": pid}
    for s in ("3", "4", "12"):  # steps without per-process state
      assert value(s) is None, (pid, s)
    assert got["5"].error is not None, got["5"]
    assert "holds host_state for 1 processes but this job has 2" in (
        f"{got['5'].error.type}: {got['5'].error.msg}")
  with ckpt.Checkpointer(dst) as c:
    assert c.host_state(12) is None  # saved by 2 processes, without any
    with pytest.raises(ckpt.CheckpointError, match="for 2 processes but"):
      c.host_state(11)
  names = sorted(os.listdir(dst / "checkpoint_10" / ".host_state"))
  assert names == ["0.msgpack", "1.msgpack"]


def test_skip_leaves_a_step_without_per_process_state(tmp_path, capsys):
  src = orbax_step(tmp_path / "o", 1, **per_process_json())
  add_grain_item(src)
  dst = tmp_path / "c"
  doc = json_in_process(capsys, "import", src, dst, "--step", 1, "--skip",
                        "data_iter", "--skip", "rng")
  assert doc["skipped"] == ["data_iter", "rng"]
  assert doc["host_state_processes"] == 0 and doc["items"] == {
      "state": "pytree"}
  with ckpt.Checkpointer(dst) as c:
    assert c.host_state(1) is None


def test_several_per_process_items_are_one_dict_per_process(tmp_path):
  src = orbax_step(tmp_path / "o", 1, **per_process_json())
  add_grain_item(src)
  found = orbax_import.read_step(src)
  assert found.host_states == [
      {"data_iter": grain_state(i), "rng": {"seed": 100 + i}} for i in (0, 1)]


@pytest.mark.parametrize("case,fragments", [
    ("missing", ["data_iter", "processes [1] are missing"]),
    ("counts", ["different numbers of processes", "'rng': 3",
                "'data_iter': 2"]),
    ("not_json", ["process_0-of-2.json", "is not JSON"]),
    ("big_int", ["process_1-of-2.json", "msgpack"]),
])
def test_a_bad_per_process_item_is_refused_by_name(tmp_path, capsys, case,
                                                   fragments):
  items = per_process_json(3) if case == "counts" else {}
  src = orbax_step(tmp_path / "o", 1, **items)
  states = [grain_state(0), grain_state(1)]
  if case == "big_int":
    states[1] = {"pos": 2**70}
  add_grain_item(src, states=states, files={0} if case == "missing" else None)
  if case == "not_json":
    (src / "data_iter" / "process_0-of-2.json").write_text("{not json")
  rc, out, err = in_process(capsys, "import", src, tmp_path / "c", "--step",
                            1)
  assert_one_line_error(rc, out, err, *fragments)
  assert not (tmp_path / "c").exists()  # nothing written before it
  with pytest.raises(OrbaxImportError):
    orbax_import.read_step(src)
