"""The persistent tier of a MultiTierCheckpointer: a ``Checkpointer`` whose
known steps the timeline asks (ckpt/tiers/timeline.py: ``newer_than``,
``delete``) and whose save decision past the tiers' step rules
(``save_interval_secs``, ``skip_while_saving``: ckpt/face/decision.py) the
MultiTierCheckpointer asks before it saves a step there."""

from __future__ import annotations

from typing import Any

from ckpt.checkpointer import Checkpointer
from ckpt.face import decision as decision_lib
from ckpt.face import known as known_lib


class PersistentTier(Checkpointer):
  """A ``Checkpointer`` as the persistent tier (see the module docstring)."""

  @property
  def known_steps(self) -> known_lib.KnownSteps:
    return self._known

  def verdict(self, step: int, by_steps: bool, force: bool,
              restart: bool) -> decision_lib.Verdict:
    """Whether this tier saves ``step`` (``by_steps``: the multi-tier step
    rules accept it): ``Checkpointer.save``'s decision past its step rules,
    agreed by every process when ``save_interval_secs`` or
    ``skip_while_saving`` is set (then collective)."""
    return self._queries.verdict(step, by_steps, force, restart)

  def save_as(self, step: int, state: Any, verdict: decision_lib.Verdict,
              **kwargs) -> bool:
    """``save`` of a step ``verdict`` (from ``verdict``) decided: its
    ``temporary`` mark is kept in the step's index."""
    return self._save_decided(step, state, lambda: verdict, kwargs)
