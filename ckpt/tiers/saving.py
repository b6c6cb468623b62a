"""The save of a MultiTierCheckpointer (ckpt/tiers/multitier.py) once the
tiers it writes are decided: ``custom_metadata`` checked, the timeline round
(ckpt/tiers/timeline.py ``check``: a step lower than the newest of either
tier is refused before anything is written) in which the save transforms
run, then the persistent tier's save of the step its verdict decided, then
the local tier's."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from ckpt.checkpointer import Checkpointer
from ckpt.face import decision as decision_lib
from ckpt.format import extras as save_extras
from ckpt.format import tree
from ckpt.tiers import timeline as tier_timeline
from ckpt.tiers.local_tier import LocalTier


def save(persistent: Checkpointer, local: LocalTier, step: int, state: Any,
         verdict: decision_lib.Verdict, to_local: bool,
         note: Callable[[str], None], *, metrics: dict | None,
         transforms: Sequence[Callable], host_state: Any,
         custom_metadata: dict | None, progress: Any) -> bool:
  """``MultiTierCheckpointer.save`` of ``step`` to the persistent tier (if
  ``verdict.save``) and the local tier (if ``to_local``); True if either
  saved it. ``note(tier)``: a tier is about to write (its stats are the
  last save's)."""
  save_extras.check_custom_metadata(custom_metadata)  # same on all
  prepared = [state]
  tier_timeline.check(persistent, local, step, lambda: prepared.__setitem__(
      0, tree.transformed(state, transforms)))
  state = prepared[0]
  saved = False
  if verdict.save:
    note("persistent")
    saved |= bool(persistent.tier_side.save_as(
        step, state, verdict, metrics=metrics, host_state=host_state,
        custom_metadata=custom_metadata, progress=progress))
  if to_local:
    # Retention keeps this step, whatever its number (LocalTier._retain);
    # no local save is in flight (the timeline round waited for it).
    note("local")
    local.save(step, state, host_state, newest=True)
    saved = True
  return saved


def persistent_verdict(persistent: Checkpointer, interval: int | None,
                       preemption_step: int | None, step: int,
                       force: bool = False,
                       restart: bool = False) -> decision_lib.Verdict:
  """Whether the persistent tier saves ``step``: its step rules
  (``interval``: ``persistent_interval``; the preemption step; its
  ``save_on_steps`` and ``should_save_fn``), then its
  ``save_interval_secs`` / ``skip_while_saving`` (ckpt/face/tier_side.py
  ``TierSide.verdict``: collective with either)."""
  sched = dataclasses.replace(persistent.schedule, interval=interval)
  by_steps = force or sched.by_rule(step, preemption_step) or (
      sched.fn is not None and bool(sched.fn(step,
                                             persistent.last_saved_step())))
  return persistent.tier_side.verdict(step, by_steps, force, restart)
