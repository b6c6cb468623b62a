"""``MultiTierCheckpointer`` is a drop-in for ``Checkpointer`` (issue 36
item 6): every public method and property of ``Checkpointer`` exists on it,
and every call a ``Checkpointer`` accepts it accepts the same way (the
same parameters, kinds and defaults; it may take more, each optional).
The meaning of each query is checked in real jobs
(tests/multiprocess/test_tiers_rollback.py: ``all_steps`` on 2 processes).
"""

from __future__ import annotations

import inspect

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.save.write import SaveStats

_EMPTY = inspect.Parameter.empty


def _public(cls) -> dict[str, object]:
  return {n: v for n, v in inspect.getmembers(cls)
          if not n.startswith("_") or n in ("__enter__", "__exit__")}


def _incompatible(name: str, want: inspect.Signature,
                  got: inspect.Signature) -> list[str]:
  """Why a call that fits ``want`` may not fit ``got`` (empty: it fits)."""
  params = got.parameters
  var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
  var_pos = any(p.kind is p.VAR_POSITIONAL for p in params.values())
  out = []
  for p in want.parameters.values():
    q = params.get(p.name)
    if q is None:
      if p.kind is p.VAR_POSITIONAL and var_pos:
        continue
      if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) and var_kw:
        continue
      out.append(f"{name}: no parameter {p.name!r}")
    elif q.kind is not p.kind and not (
        q.kind is q.POSITIONAL_OR_KEYWORD and p.kind is p.KEYWORD_ONLY):
      out.append(f"{name}({p.name}): {q.kind.description}, "
                 f"Checkpointer's is {p.kind.description}")
    elif q.default is not _EMPTY and p.default is _EMPTY:
      pass  # optional where Checkpointer requires it: fits
    elif q.default is _EMPTY and p.default is not _EMPTY:
      out.append(f"{name}({p.name}): required, Checkpointer's defaults to "
                 f"{p.default!r}")
    elif not (q.default is p.default or (
        q.default == p.default and type(q.default) is type(p.default))):
      out.append(f"{name}({p.name}): default {q.default!r}, Checkpointer's "
                 f"is {p.default!r}")
  wanted = set(want.parameters)
  for q in params.values():  # more parameters: each must be optional
    if (q.name not in wanted and q.default is _EMPTY and
        q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)):
      out.append(f"{name}: extra required parameter {q.name!r}")
  return out


def test_every_public_checkpointer_call_exists_with_a_compatible_signature():
  want, got = _public(ckpt.Checkpointer), _public(ckpt.MultiTierCheckpointer)
  missing = sorted(set(want) - set(got))
  assert not missing, f"MultiTierCheckpointer lacks {missing}"
  problems = []
  for name, member in want.items():
    other = got[name]
    if isinstance(member, property):
      if not isinstance(other, property):
        problems.append(f"{name}: a property on Checkpointer, "
                        f"{type(other).__name__} on MultiTierCheckpointer")
      continue
    problems += _incompatible(name, inspect.signature(member),
                              inspect.signature(other))
  assert not problems, "\n".join(problems)
  # the queries the issue names, by name (the comparison above covers them)
  for name in ("all_steps", "latest_step", "metrics", "best_step",
               "metadata", "host_state", "should_save", "directory",
               "reload", "delete", "restore", "save"):
    assert name in got, name


def test_the_comparison_catches_what_breaks_a_drop_in():
  def f(self, step, *, target=None, lazy=False):
    del self, step, target, lazy

  def no_lazy(self, step, *, target=None):
    del self, step, target

  def lazy_true(self, step, *, target=None, lazy=True):
    del self, step, target, lazy

  def kwargs(self, step, *, target=None, **rest):
    del self, step, target, rest

  def extra(self, step, more, *, target=None, lazy=False):
    del self, step, more, target, lazy

  sig = inspect.signature
  assert _incompatible("f", sig(f), sig(kwargs)) == []
  assert _incompatible("f", sig(f), sig(no_lazy)) == [
      "f: no parameter 'lazy'"]
  assert _incompatible("f", sig(f), sig(lazy_true)) == [
      "f(lazy): default True, Checkpointer's is False"]
  assert _incompatible("f", sig(f), sig(extra)) == [
      "f: extra required parameter 'more'"]


def test_single_process_queries_mean_what_checkpointer_means(tmp_path):
  state = {"w": np.arange(8.0), "n": 3}
  with ckpt.MultiTierCheckpointer(
      tmp_path / "p", local=tmp_path / "l", local_interval=1,
      persistent_interval=2, local_keep=2) as m:
    for step in range(1, 6):
      m.save(step, state, metrics={"loss": float(10 - step)})
    m.wait_until_finished()
    # persistent: 2, 4; local: 4, 5 (keep 2)
    assert m.persistent.all_steps() == [2, 4]
    assert m.all_steps() == [2, 4, 5]
    assert m.all_steps()[-1] == m.latest_step() == 5
    assert m.metrics(4) == {"loss": 6.0}
    m.reload()
    assert m.metrics(2) == {"loss": 8.0}
    # save transforms apply to both tiers, as Checkpointer.save's
    m.save(6, state, force=True,
           transforms=[lambda d: {"renamed": d["w"], "n": d["n"]}])
    m.wait_until_finished()
    assert m.all_steps() == [2, 4, 5, 6]
    got = ckpt.load(tmp_path / "p", 6)
    assert sorted(got) == ["n", "renamed"]


def test_the_stats_are_those_of_the_last_tier_written_or_read(tmp_path):
  """``last_save_stats`` / ``last_restore_stats`` / ``last_restore_step``
  as on a Checkpointer: what the last save's last tier wrote (the local
  tier's dict, the persistent tier's SaveStats) and what the last restore
  read, from the tier it chose."""
  sharding = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4),
                                ("a", "b")), P("a", "b"))
  value = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
  state = {"w": jax.device_put(value, sharding)}
  target = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype,
                                      sharding=sharding)}
  with ckpt.MultiTierCheckpointer(
      tmp_path / "p", local=tmp_path / "l", local_interval=2,
      persistent_interval=3, local_keep=2) as m:
    # before any save or restore: the persistent tier's (empty) stats
    assert m.last_save_stats.step == -1
    assert m.last_restore_stats.bytes_read == 0
    assert m.last_restore_step is None
    m.save(3, state)  # the persistent tier only
    m.wait_until_finished()
    p_stats = m.last_save_stats
    assert isinstance(p_stats, SaveStats)
    assert p_stats is m.persistent.last_save_stats
    assert p_stats.step == 3 and p_stats.bytes_written == value.nbytes
    m.save(4, state)  # the local tier only
    m.wait_until_finished()
    l_stats = m.last_save_stats
    assert l_stats is m.local.last_save_stats
    assert l_stats["step"] == 4 and l_stats["own_bytes"] == value.nbytes
    assert l_stats["total_s"] > 0  # committed
    assert m.save(5, state) is False  # no tier: the last save's stay
    assert m.last_save_stats is l_stats
    m.save(6, state)  # both tiers: the local tier's (written last)
    m.wait_until_finished()
    assert m.last_save_stats["step"] == 6
    assert m.persistent.last_save_stats.step == 6

    got = m.restore()  # no target: the persistent tier
    assert m.last_restore_tier == "persistent" and m.last_restore_step == 6
    assert m.last_restore_stats is m.persistent.last_restore_stats
    assert m.last_restore_stats.fetched_bytes >= value.nbytes
    np.testing.assert_array_equal(got["w"], value)
    m.save(8, state)  # the local tier only: newer than the persistent 6
    m.wait_until_finished()
    got = m.restore(target=target)
    assert m.last_restore_tier == "local" and m.last_restore_step == 8
    assert m.last_restore_stats is m.local.last_restore_stats
    assert m.last_restore_stats["step"] == 8
    assert m.last_restore_stats["bytes_read"] == value.nbytes
    np.testing.assert_array_equal(np.asarray(got["w"]), value)
