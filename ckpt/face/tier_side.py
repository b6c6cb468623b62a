"""What a ``MultiTierCheckpointer`` (ckpt/tiers/multitier.py) asks of the
``Checkpointer`` that is its persistent tier, besides that Checkpointer's
public calls: ``Checkpointer.tier_side``, a ``TierSide``. Not a user's call.

The tiers' timeline (ckpt/tiers/timeline.py) asks which committed steps are
newer than a step (``newer_than``) and deletes a step in its own round
(``delete_now``, then ``deleted`` on every process); their queries and
choice skip the steps a resume fell back past (``damaged_steps``); a
restore lets the save in flight end first (``settle``); and a save asks the
decision past the tiers' own step rules (``verdict``: ``save_interval_secs``,
``skip_while_saving``) before it saves the step it decided (``save_as``).
"""

from __future__ import annotations

from typing import Any

from ckpt.face import decision as decision_lib
from ckpt.face import inflight as inflight_lib
from ckpt.face import known as known_lib
from ckpt.face import queries as queries_lib
from ckpt.face import retention as retention_lib
from ckpt.face import rounds as rounds_lib
from ckpt.face import save_call as save_call_lib


class TierSide:
  """The persistent tier's calls for its MultiTierCheckpointer (see the
  module docstring); each hands its call to the part that owns it."""

  def __init__(self, known: known_lib.KnownSteps,
               retention: retention_lib.Retention, rounds: rounds_lib.Rounds,
               inflight: inflight_lib.InFlightSave,
               queries: queries_lib.Queries,
               save_call: save_call_lib.SaveCall):
    self._known = known
    self._retention = retention
    self._rounds = rounds
    self._inflight = inflight
    self._queries = queries
    self._save_call = save_call

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
    """``Checkpointer.save`` of a step ``verdict`` (from ``verdict``)
    decided: its ``temporary`` mark is kept in the step's index."""
    return self._save_call.save(step, state, lambda: verdict, kwargs)
