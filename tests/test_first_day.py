"""An Orbax user's first day (issue 25): errors that name the leaf, and a
command line whose output is ckpt's own."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli import main as cli

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def mesh():
  return jax.make_mesh((4, 2), ("data", "model"))


@pytest.fixture
def saved(tmp_path, mesh):
  with ckpt.Checkpointer(tmp_path / "run") as c:
    c.save(1, {"a": {"w": jax.device_put(jnp.arange(10.0),
                                          NamedSharding(mesh, P()))},
               "b": jax.device_put(jnp.ones((8, 4)), NamedSharding(
                   mesh, P("data", "model")))})
  return tmp_path / "run"


def test_a_target_sharding_that_does_not_divide_names_the_leaf(saved, mesh):
  target = {"a": {"w": jax.ShapeDtypeStruct(
      (10,), jnp.float32, sharding=NamedSharding(mesh, P("data")))},
            "b": jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                      sharding=NamedSharding(mesh, P()))}
  with ckpt.Checkpointer(saved) as c:
    for lazy in (False, True):
      with pytest.raises(ckpt.TreeMismatchError) as e:
        c.restore(target=target, lazy=lazy)
      assert ("leaf 'a/w': the target's sharding P('data',) over the mesh "
              "{'data': 4, 'model': 2} does not divide its shape (10,)"
              in str(e.value)), e.value
      assert "dimension 0 has size 10, split over 4 devices" in str(e.value)


@pytest.mark.parametrize("spec", [P("data"), P(), None])
@pytest.mark.parametrize("async_save", [True, False])
def test_saving_a_deleted_array_names_the_leaf(tmp_path, mesh, spec,
                                               async_save):
  x = jnp.arange(8.0)
  if spec is not None:  # sharded, replicated (inlined); else one device
    x = jax.device_put(x, NamedSharding(mesh, spec))
  x.delete()
  with ckpt.Checkpointer(tmp_path / "run", async_save=async_save) as c:
    # Replicated or one-device (read when the save is planned): refused
    # before the round; sharded: when staging, naming the leaf too.
    with pytest.raises(ckpt.CheckpointError,
                       match=r"leaf 'opt/mu'.*(been deleted|array deleted)"):
      c.save(1, {"opt": {"mu": x}, "step": 1})
      c.wait_until_finished()  # async: a staging failure is reported here
    assert c.all_steps() == []
    c.save(2, {"opt": {"mu": jnp.ones(3)}})  # the next save works
    c.wait_until_finished()
    assert c.all_steps() == [2]


def test_an_abstract_target_rule_that_matches_no_leaf_is_refused(saved, mesh):
  with ckpt.Checkpointer(saved) as c:
    md = c.metadata(1)
  with pytest.raises(ckpt.TreeMismatchError,
                     match=r"abstract_target rule pattern 'params/.\*' "
                     r"matches no checkpoint leaf; leaves are: \['a/w', 'b'\]"):
    ckpt.abstract_target(md, mesh, [("b", P("data")), ("params/.*", P())])
  t = ckpt.abstract_target(md, mesh, [("b", P("data")), ("params/.*", P())],
                           strict=False)
  assert t["b"].sharding.spec == P("data")


def test_one_wording_for_a_step_that_is_not_committed(saved):
  want = (f"step 5 is not a committed checkpoint in {str(saved)!r}; "
          "committed steps: [1]")
  with ckpt.Checkpointer(saved) as c:
    calls = [lambda: c.restore(5), lambda: c.metadata(5),
             lambda: c.metrics(5), lambda: c.host_state(5),
             lambda: ckpt.load(saved, 5)]
    for call in calls:
      with pytest.raises(ckpt.CheckpointNotFoundError) as e:
        call()
      assert str(e.value) == want
    with pytest.raises(ckpt.CheckpointNotFoundError) as e:
      c.delete(5)
    assert str(e.value) == f"cannot delete step 5: {want}"


def test_gc_accepts_dry_run(saved, capsys):
  with ckpt.Checkpointer(saved) as c:
    c.save(2, {"x": np.ones(3)})
  assert cli.main(["gc", str(saved), "--keep", "1", "--dry-run"]) == 0
  assert "dry run: nothing deleted" in capsys.readouterr().out
  assert sorted(os.listdir(saved)) == ["checkpoint_1", "checkpoint_2"]
  with pytest.raises(SystemExit):
    cli.main(["gc", str(saved), "--keep", "1", "--dry-run", "--yes"])


def test_the_command_line_prints_only_its_own_error_without_credentials(
    tmp_path):
  with socket.socket() as s:  # a port nothing listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path),
         "JAX_PLATFORMS": "cpu", "AWS_REGION": "us-east-1",
         "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
         "AWS_EC2_METADATA_DISABLED": "true"}
  opts = ('{"s3_request_retries": {"max_retries": 1, "initial_delay": '
          '"0.1s", "max_delay": "0.1s"}}')
  args = [sys.executable, "-m", "ckpt", "ls", "s3://bucket/run",
          "--storage-options", opts]
  proc = subprocess.run(args, env=env, cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 1
  assert proc.stderr.startswith("ckpt: error: ") and (
      proc.stderr.count("\n") == 1), proc.stderr
  # CKPT_DEBUG keeps what the native libraries said (here, the AWS SDK
  # looking for credentials), which is what made the output noisy.
  debug = subprocess.run(args, env=dict(env, CKPT_DEBUG="1"), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
  assert debug.returncode != 0
  assert "credentials" in debug.stderr.lower(), debug.stderr[-2000:]
