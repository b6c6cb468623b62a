"""The restore of a MultiTierCheckpointer (ckpt/tiers/multitier.py): the
agreed choice of step and tier, then the local tier's read (and exchange
with partners) or the persistent tier's ``restore`` / ``restore_async``."""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import jax
from absl import logging

from ckpt.checkpointer import Checkpointer
from ckpt.errors import CheckpointError, CheckpointNotFoundError
from ckpt.store.progress import rate_text, size_text
from ckpt.multihost import process as multihost
from ckpt.restore import handle as handle_lib
from ckpt.tiers import choice as tier_choice
from ckpt.tiers import local_leaves
from ckpt.tiers.local_tier import LocalTier
from ckpt.restore import targets


def restore(persistent: Checkpointer, local: LocalTier, note: Callable,
            step: int | None, target: Any, restore_kwargs: dict,
            start: bool = False) -> Any:
  """``MultiTierCheckpointer.restore`` (``start``: ``restore_async``, a
  handle), once the persistent tier's save in flight has ended (its
  failure stays for the next save or wait; the local tier's save ends in
  the choice). ``note(tier, step, reason, restored)``: what came back."""
  persistent.tier_side.settle()

  def choose(step: int | None, leaves, options: str) -> dict:
    """The agreed tier and step (ckpt/tiers/choice.py; collective)."""
    return tier_choice.choose(persistent, local, step, leaves, options)

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
    state = _local(local, note, d, leaves, treedef)
    if step is None:
      _resumed(local, d, d["step"], "local", local.root)
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
    for c in d.get("older", ()):  # it fell back past a local step: take
      if s is not None and c > s:  # the newest the local tier can rebuild
        d2 = choose(c, leaves, options)
        if d2["tier"] == "local":
          logging.warning(
              "ckpt: the persistent tier fell back to step %s; the local "
              "tier's step %d is newer: resuming it instead", s, c)
          del state  # the persistent step's arrays, before the local read
          got = _local(local, note, d2, leaves, treedef)
          _resumed(local, d, c, "local", local.root)
          return got
    try:
      hs = persistent.host_state(s)
    except CheckpointError as e:
      logging.info("ckpt: no host_state in persistent step %s: %s", s, e)
      hs = None
    note("persistent", s, reason, (s, hs))
    if step is None and s is not None:
      _resumed(local, d, s, "persistent", persistent.storage.url)
    return state
  if not start:
    return finish(persistent.restore(which, target=target, **restore_kwargs))
  inner = persistent.restore_async(which, target=target, **restore_kwargs)
  return handle_lib.RestoreHandle(
      lambda timeout: finish(inner.result(timeout)), inner,
      lambda: inner.cancel("the MultiTierCheckpointer was closed"),
      lambda: None, inner.what)


def _local(local: LocalTier, note: Callable, d: dict, leaves, treedef) -> Any:
  """The local tier's restore of the agreed step ``d["step"]``."""
  out, hs = local.restore(d["step"], leaves, d["need"])
  st = local.last_restore_stats
  logging.info("ckpt: restored step %d from the local tier %s: this process "
               "read %s in %.2f s (%s)%s", d["step"], local.root,
               size_text(st["bytes_read"]), st["total_s"],
               rate_text(st["bytes_read"], st["total_s"]),
               f"; {d['reason']}" if d["reason"] else "")
  note("local", d["step"], d.get("reason", ""), (d["step"], hs))
  return jax.tree_util.tree_unflatten(treedef, [out[n] for n, _ in leaves])


def _resumed(local: LocalTier, d: dict, step: int, tier: str, where: str) -> None:
  """After a resume returned ``step`` (every process): the local steps
  above it are set aside (one timeline: no query, restore or save refusal
  of this job sees them; the next local save removes them), and process 0
  says once, as a WARNING, which local steps the resume passed over, the
  first reason and what to do."""
  local.set_aside_above(step)
  newer = [s for s in d.get("held", ()) if s > step]
  if not newer or multihost.process_index() != 0:
    return
  why = d.get("first_why") or d.get("reason") or "not usable"
  advice = ""
  if "sharded differently" in why:
    advice = (" To resume from the local tier, restore onto the shardings "
              "the state was saved with: give the target the shardings "
              "the train step's outputs have (its out_shardings; see "
              "docs/multi-tier.md, 'Restore onto the saved shardings').")
  logging.warning(
      "ckpt: resumed step %d from the %s tier %s; the local tier's newer "
      "step(s) %s were not used (%s). They are set aside: the next local "
      "save removes them.%s", step, tier, where, newer, why[:600], advice)


def _done(value: Any, what: str) -> handle_lib.RestoreHandle:
  """A handle whose restore is already done."""
  reads = concurrent.futures.Future()
  reads.set_result(None)
  return handle_lib.RestoreHandle(lambda timeout: value, reads, lambda: None,
                                  lambda: None, what)
