"""When to save: the steps ``save_interval_steps``, ``save_on_steps`` and
``should_save_fn`` accept (Orbax's names). Pure: no I/O, no state; the
rules that need the directory (a run's first step, ``should_save_fn``'s
``last_saved_step``) are asked by its users (ckpt/face/queries.py,
ckpt/tiers/multitier.py)."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable


def _step(s: Any) -> int:
  s = operator.index(s)
  if s < 0:
    raise ValueError(f"{s} is negative")
  return s


@dataclasses.dataclass(frozen=True)
class SaveSchedule:
  """``interval``: every N-th step (None: none); ``on_steps``: these steps;
  ``fn(step, last_saved_step) -> bool``: a step it accepts. All None:
  every step."""
  interval: int | None = None
  on_steps: frozenset[int] | None = None
  fn: Callable[[int, int | None], bool] | None = None

  @classmethod
  def of(cls, interval: Any = None, on_steps: Any = None,
         fn: Any = None) -> "SaveSchedule":
    """Checks the Checkpointer's keyword arguments (ValueError naming the
    argument, what it must be and what it got)."""
    if interval is not None and (type(interval) is not int or interval < 1):
      raise ValueError("save_interval_steps must be a positive int or None, "
                       f"got {interval!r}")
    if on_steps is not None:
      try:
        on_steps = frozenset(_step(s) for s in on_steps)
      except (TypeError, ValueError) as e:
        raise ValueError("save_on_steps must be a collection of non-negative "
                         f"int steps, got {on_steps!r}: {e}") from None
    if fn is not None and not callable(fn):
      raise ValueError("should_save_fn must be a callable (step, "
                       f"last_saved_step) -> bool, got {fn!r}")
    return cls(interval, on_steps, fn)

  @property
  def every_step(self) -> bool:
    return self.interval is None and self.on_steps is None and self.fn is None

  def by_rule(self, step: int, preemption_step: int | None,
              interval: int | None = None) -> bool:
    """Whether ``step`` is accepted without the directory: a multiple of
    the interval (``interval`` overrides it), the preemption step, or one
    of ``on_steps``."""
    n = self.interval if interval is None else interval
    return ((n is not None and step % n == 0) or step == preemption_step or
            (self.on_steps is not None and step in self.on_steps))
