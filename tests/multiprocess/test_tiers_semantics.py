"""The local tier means what the persistent tier means (issue 23 item 7).

One job (2 processes x 2 CPU devices, tests/multiprocess/
tiers_semantics_worker.py) saves each case's state with a plain
``Checkpointer`` and with a ``MultiTierCheckpointer`` whose persistent tier
stays empty, and restores each target with both: the local tier must return
the same leaves (type, dtype, shape, sharding, every shard's bytes) or raise
the same error naming the leaf, on every process; then again after process
1's local directory is wiped (its part comes from its partner's replica).
"""

from __future__ import annotations

import pathlib

import pytest

from ckpt.multihost import local_cluster
from tests.multiprocess import worker
from tests.multiprocess.tiers_semantics_worker import Got, Result

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
WORKER = "tests.multiprocess.tiers_semantics_worker"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  root = tmp_path_factory.mktemp("semantics")
  return [worker.decode(Result, r) for r in local_cluster.check(
      local_cluster.run(WORKER, {"root": str(root)}, num_processes=2,
                        devices_per_process=2, timeout_s=240,
                        cwd=REPO_ROOT))]


NOTHING = Got(leaves={})  # a call that returned None


def _cases(results, case):
  """(process, that process's outcome of ``case``) for both processes."""
  return [(p, getattr(r, case)) for p, r in enumerate(results)]


def _same_result(results, case, label, *, partner=False):
  for p, out in _cases(results, case):
    assert out.save == NOTHING and out.wait == NOTHING, (
        p, out.save, out.wait)
    got = out.restores[label]
    assert got.ckptr.error is None, (p, got.ckptr)
    assert got.mt == got.ckptr, (p, label, {
        k: (v, got.ckptr.leaves.get(k))
        for k, v in (got.mt.leaves or {}).items()
        if v != got.ckptr.leaves.get(k)})
    assert got.tier == "local", (p, label, got.tier)
    if partner:  # process 1's own part came from its partner
      assert got.from_partner is (p == 1), (p, got.from_partner)


def _same_error(results, case, label, error, leaf):
  for p, out in _cases(results, case):
    got = out.restores[label]
    assert got.ckptr.error is not None and got.ckptr.error.type == error, (
        p, got.ckptr)
    assert got.mt.error is not None and got.mt.error.type == error, (
        p, got.mt)
    assert f"leaf {leaf!r}" in got.mt.error.msg, (p, got.mt)
    assert got.ckptr.error.msg in got.mt.error.msg, (p, got)


@pytest.mark.parametrize("label,leaf", [
    ("w_int", "w"), ("h_int", "h"), ("i_float", "i"), ("w_shape", "w"),
    ("w_int/wiped", "w"), ("h_int/wiped", "h")])
def test_refusals_are_the_persistent_tiers(results, label, leaf):
  """A float32 leaf into an int32 target came back truncated ([0 1 2] for
  [0.7 1.7 2.7]) from the local tier; the persistent tier refuses. Every
  process raises its TreeMismatchError, the same message, also the process
  that restores from its partner's replica (it holds no saved leaves)."""
  _same_error(results, "refusal", label, "TreeMismatchError", leaf)
  msgs = {out.restores[label].mt.error.msg
          for _, out in _cases(results, "refusal")}
  assert len(msgs) == 1, msgs


def test_after_a_refusal_a_good_target_restores(results):
  _same_result(results, "refusal", "good")
  _same_result(results, "refusal", "good/wiped", partner=True)


@pytest.mark.parametrize("case", ["restore_dtype", "save_dtype"])
@pytest.mark.parametrize("label", ["arrays", "all", "arrays/wiped",
                                   "all/wiped"])
def test_save_and_restore_dtype_as_the_persistent_tier(results, case, label):
  """restore_dtype="bfloat16" applied to the persistent tier only, and
  save_dtype too: the local tier returned float32 where a Checkpointer
  returns bfloat16 (restore_dtype) or bfloat16-rounded values (save_dtype).
  Floating leaves only: int32, Python values are as saved. ("all": a numpy
  leaf restored onto a sharded target, a jax array as a Checkpointer gives,
  where the local tier used to fall back to the persistent tier.)"""
  _same_result(results, case, label, partner=label.endswith("wiped"))
  for p, out in _cases(results, case):
    dtypes = {k: v.dtype for k, v in out.restores[label].mt.leaves.items()}
    floating = "bfloat16" if case == "restore_dtype" else "float32"
    assert dtypes == {"['w']": floating, "['r']": floating, "['h']": floating,
                      "['s']": "bfloat16", "['i']": "int32",
                      "['step']": "int64", "['p']": None}, (p, dtypes)
    if case == "save_dtype":  # stored in bfloat16 in the local tier too
      assert out.manifest == {"w": "bfloat16", "r": "bfloat16",
                              "i": "int32"}, (p, out.manifest)


@pytest.mark.parametrize("label", ["all", "all/wiped"])
def test_typed_prng_keys(results, label):
  """Typed keys (sharded threefry, replicated rbg, an uncommitted key on each
  process) were refused by the local tier; now bit-exact, same key dtypes
  and shardings as a Checkpointer's restore."""
  _same_result(results, "keys", label, partner=label.endswith("wiped"))
  leaves = results[0].keys.restores[label].mt.leaves
  assert leaves["['k']"].dtype == "key<fry>"
  assert leaves["['rbg']"].dtype == "key<rbg>"


@pytest.mark.parametrize("label,leaf", [
    ("other_impl", "k"), ("not_keys", "w"),
    ("other_impl/wiped", "k"), ("not_keys/wiped", "w")])
def test_key_mismatches_are_refused_alike(results, label, leaf):
  _same_error(results, "keys", label, "TreeMismatchError", leaf)


def test_uncommitted_single_device_arrays(results):
  """jnp.asarray(10) in a 2-process job lives on one device of each process:
  the local save raised KeyError(CpuDevice(id=1)), and close raised it again.
  Now saved as a host value, as the persistent tier stores it inline."""
  for p, out in _cases(results, "save_then_close"):
    assert (out.save, out.close) == (NOTHING, NOTHING), (p, out)
  for p, out in _cases(results, "uncommitted"):
    assert out.close == NOTHING, (p, out.close)
  _same_result(results, "uncommitted", "all")
  leaves = results[0].uncommitted.restores["all"].mt.leaves
  assert leaves["['c']"].type == "jax.Array"    # restored as saved:
  assert "SingleDeviceSharding" in leaves["['c']"].sharding  # one device
  assert leaves["['f']"].type == "jax.Array"    # onto the target's device


def test_uneven_target_sharding(results):
  """A target sharding that does not divide the leaf (5 rows, 4 devices):
  the persistent tier raises TreeMismatchError naming the leaf; the local
  tier fell back to the (empty) persistent tier and raised
  CheckpointNotFoundError. Now the same error, naming the leaf."""
  _same_error(results, "uneven", "uneven", "TreeMismatchError", "u")
