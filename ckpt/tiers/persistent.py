"""The persistent tier of a MultiTierCheckpointer: a ``Checkpointer`` whose
known steps the timeline asks (ckpt/tiers/timeline.py: ``newer_than``,
``delete_now``) and whose save decision past the tiers' step rules
(``save_interval_secs``, ``skip_while_saving``: ckpt/face/decision.py) the
MultiTierCheckpointer asks before it saves a step there."""

from __future__ import annotations

from typing import Any

from ckpt.checkpointer import Checkpointer
from ckpt.face import decision as decision_lib


class PersistentTier(Checkpointer):
  """A ``Checkpointer`` as the persistent tier (see the module docstring)."""

  def damaged_steps(self) -> frozenset[int]:
    """The steps a resume of this job fell back past (never resumed)."""
    return self._retention.damaged()

  def newer_than(self, step: int, fresh: bool = False) -> list[int]:
    """Process 0: the committed steps above ``step`` and the step of the
    save in flight if above, but the damaged ones, within the query bound
    (ckpt/face/known.py ``newer_than``)."""
    damaged = self._retention.damaged()
    return [s for s in self._known.newer_than(
        step, self._inflight.step_running(),
        self._rounds.timeouts.query_deadline(), damaged, fresh)
            if s not in damaged]

  def delete_now(self, step: int) -> bool:
    """Process 0, in a delete round: deletes ``step`` (within the query
    bound, as the round's answer)."""
    return self._rounds.local(lambda: self._queries.delete_now(step))

  def deleted(self, step: int) -> None:
    """Every process, once the round deleted ``step``."""
    self._queries.deleted(step)

  def settle(self) -> None:
    """Lets the save in flight end (its failure stays for the next save
    or wait): a restore of the latest step wants its commit."""
    self._inflight.settle()

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
