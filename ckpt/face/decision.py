"""The part of the save decision that process 0 takes for the whole job.

``save_interval_secs`` (save once this many seconds passed since the last
save, Levanter's ``save_interval``, Orbax's time-based save-decision
policy) and ``skip_while_saving`` (a save while the previous one is still
writing returns False at once, Orbax's continuous checkpointing) depend on
a clock and on a save's progress, which differ between processes. So
process 0 answers from its own clock and its own save in flight, in one
read round (ckpt/multihost/agreement.py, the round ``should_save`` already
makes for its first-step rule), and every process takes its answer: all
save the same steps, whatever their clocks say.

Call sequence: ``Queries.decide`` first asks the step rules (pure, or
agreed: ckpt/save/schedule.py); then ``SaveDecision.decide(step,
by_steps, exempt, ask, restart)``: with either option, one round per call
(a ``save`` or ``should_save`` of any step), in which process 0 answers
from its own step rules, clock and save in flight; without them, no round.
A save's decision (``restart``, not ``should_save``'s) restarts process
0's timer when it saves: the interval runs from the last save, whatever
decided it.

A step saved only because the interval passed is *temporary* with
``temporary_time_saves=True`` (its index says so; retention deletes it once
a newer step commits: ckpt/commit/retention.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ckpt.commit import retention
from ckpt.face import inflight as inflight_lib
from ckpt.multihost import process as multihost


@dataclasses.dataclass(frozen=True)
class Verdict:
  """Whether to save a step, and whether it is temporary."""
  save: bool
  temporary: bool = False


@dataclasses.dataclass(frozen=True)
class DecisionOptions:
  """``save_interval_secs``, ``skip_while_saving``, ``temporary_time_saves``
  (see Checkpointer), checked."""
  interval_s: float | None = None
  skip_while_saving: bool = False
  temporary: bool = False

  @classmethod
  def of(cls, save_interval_secs: Any, skip_while_saving: Any,
         temporary_time_saves: Any) -> "DecisionOptions":
    for name, v in (("skip_while_saving", skip_while_saving),
                    ("temporary_time_saves", temporary_time_saves)):
      if type(v) is not bool:
        raise ValueError(f"{name} must be True or False, got {v!r}")
    interval = retention.seconds(save_interval_secs, "save_interval_secs")
    if temporary_time_saves and interval is None:
      raise ValueError("temporary_time_saves=True needs save_interval_secs "
                       "(the steps it saves are the temporary ones)")
    return cls(interval, skip_while_saving, temporary_time_saves)

  @property
  def active(self) -> bool:
    return self.interval_s is not None or self.skip_while_saving


class SaveDecision:
  """Process 0's clock and save in flight, agreed (see the module
  docstring)."""

  def __init__(self, options: DecisionOptions, clock: Callable[[], Any],
               inflight: inflight_lib.InFlightSave):
    self.options = options
    self._clock = clock
    self._inflight = inflight
    # Process 0: when the last save was decided; the interval first runs
    # from when the Checkpointer was made (as Levanter's Checkpointer).
    self._last_s = (retention.now_s(clock) if options.interval_s is not None
                    and multihost.process_index() == 0 else None)

  def decide(self, step: int, by_steps: bool, exempt: bool,
             ask: Callable[[str, Callable[[], Any]], Any],
             restart: bool = False) -> Verdict:
    """``by_steps``: the step rules accept ``step``; ``exempt``: never
    skipped (a forced or preemption save); ``ask(what, fn)``: the read
    round in which process 0 computes ``fn()`` (Queries._asker);
    ``restart``: a save's decision (not ``should_save``'s): process 0's
    interval runs from now if it saves.

    With either option every call makes the round, whatever this process's
    step rules said: what process 0's rules say is what counts, so a
    process whose own view differs (a listing raced with a commit) still
    takes part in the same round and follows."""
    if not self.options.active:
      return Verdict(by_steps or exempt)
    save, temporary = ask(
        f"whether to save step {step} (process 0's clock and save in flight)",
        lambda: self._answer(by_steps, exempt, restart))
    return Verdict(bool(save), bool(temporary))

  def _answer(self, by_steps: bool, exempt: bool,
              restart: bool) -> list[bool]:
    """Process 0, in the round: [save, temporary]. A failure of the clock
    here fails the round on every process alike."""
    o = self.options
    if not exempt and o.skip_while_saving and self._inflight.running():
      return [False, False]
    now = (retention.now_s(self._clock) if self._last_s is not None
           else None)
    by_time = (not (by_steps or exempt) and now is not None and
               now - self._last_s >= o.interval_s)
    save = by_steps or exempt or by_time
    if save and restart and now is not None:
      self._last_s = now
    return [save, by_time and o.temporary]
