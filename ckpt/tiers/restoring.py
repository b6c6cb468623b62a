"""The restore of a MultiTierCheckpointer (ckpt/tiers/multitier.py): the
agreed choice of step and tier, then the local tier's read (and exchange
with partners) or the persistent tier's ``restore`` / ``restore_async``."""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import jax
from absl import logging

from ckpt.errors import CheckpointError, CheckpointNotFoundError
from ckpt.restore import handle as handle_lib
from ckpt.tiers import choice as tier_choice
from ckpt.tiers import local_leaves
from ckpt.restore import targets


def restore(persistent, local, choose: Callable, note: Callable,
            step: int | None, target: Any, restore_kwargs: dict,
            start: bool = False) -> Any:
  """``MultiTierCheckpointer.restore`` (``start``: ``restore_async``, a
  handle). ``choose(step, leaves, options)``: the agreed decision;
  ``note(tier, step, reason, restored)``: what came back."""
  if target is not None:  # jax.eval_shape's abstract meshes: on devices
    target = targets.concrete_target(target)
  leaves, treedef = (local_leaves.flatten(target) if target is not None else
                     (None, None))
  if restore_kwargs.get("path") is not None:  # another checkpoint's root
    note("persistent", step, "restore(path=...) reads that checkpoint", None)
    if start:
      return persistent.restore_async(step, target=target, **restore_kwargs)
    return persistent.restore(step, target=target, **restore_kwargs)
  options = tier_choice.persistent_options(restore_kwargs)
  d = choose(step, leaves, options)  # waits for the local tier's save
  if d["tier"] == "error":
    raise (CheckpointNotFoundError if d["not_found"] else CheckpointError)(
        d["reason"])
  if d["tier"] == "local":
    out, hs = local.restore(d["step"], leaves, d["need"])
    logging.info("ckpt: restored step %d from the local tier %s%s", d["step"],
                 local.root, f": {d['reason']}" if d["reason"] else "")
    note("local", d["step"], d.get("reason", ""), (d["step"], hs))
    state = jax.tree_util.tree_unflatten(treedef, [out[n] for n, _ in leaves])
    return _done(state, f"restore of step {d['step']}") if start else state
  reason = d.get("reason") or "restore options the local tier does not take"
  logging.info("ckpt: restoring step %s from the persistent tier %s: %s",
               d["step"], persistent.storage.url, reason)
  note("persistent", None, reason, None)  # the step: once restored
  # A resume (step=None) lets the persistent tier fall back past a step
  # that fails verification (Checkpointer.restore); it says which came.
  which = None if step is None else d["step"]

  def finish(state):
    s = persistent.last_restore_step
    try:
      hs = persistent.host_state(s)
    except CheckpointError as e:
      logging.info("ckpt: no host_state in persistent step %s: %s", s, e)
      hs = None
    note("persistent", s, reason, (s, hs))
    return state
  if not start:
    return finish(persistent.restore(which, target=target, **restore_kwargs))
  inner = persistent.restore_async(which, target=target, **restore_kwargs)
  return handle_lib.RestoreHandle(
      lambda timeout: finish(inner.result(timeout)), inner,
      lambda: inner.cancel("the MultiTierCheckpointer was closed"),
      lambda: None, inner.what)


def _done(value: Any, what: str) -> handle_lib.RestoreHandle:
  """A handle whose restore is already done."""
  reads = concurrent.futures.Future()
  reads.set_result(None)
  return handle_lib.RestoreHandle(lambda timeout: value, reads, lambda: None,
                                  lambda: None, what)
