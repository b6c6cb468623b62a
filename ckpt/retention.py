"""Which committed steps to delete after a save. Pure: steps and metrics in,
steps out; process 0 applies the answer (stage 8)."""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
  """``keep`` newest (or best, with ``best_metric``); see Checkpointer."""
  keep: int | None = None
  keep_period: int | None = None
  best_metric: str | None = None
  best_mode: str = "min"
  keep_checkpoints_without_metrics: bool = True

  def __post_init__(self):
    if self.keep is not None and (type(self.keep) is not int or self.keep < 1):
      raise ValueError(f"keep must be a positive int or None, got {self.keep!r}")
    if self.keep_period is not None and (
        type(self.keep_period) is not int or self.keep_period < 1):
      raise ValueError(
          f"keep_period must be a positive int or None, got {self.keep_period!r}")
    if self.best_mode not in ("min", "max"):
      raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")

  def to_delete(self, steps: list[int],
                metrics: Mapping[int, Mapping[str, float]],
                protected: frozenset[int] = frozenset()) -> list[int]:
    """Steps to delete. Never the newest, a ``keep_period`` multiple, or a
    protected step (being restored or written)."""
    if self.keep is None or not steps:
      return []
    steps = sorted(steps)
    newest = steps[-1]
    if self.best_metric is None:
      ranked = sorted(steps, reverse=True)
      exempt: set[int] = set()
    else:
      scored = [s for s in steps if self.best_metric in metrics.get(s, {})]
      unscored = [s for s in steps if s not in set(scored)]
      sign = 1.0 if self.best_mode == "min" else -1.0
      # NaN (a diverged run) ranks worst: it compares false with everything
      # and would otherwise scramble the order.
      scored.sort(key=lambda s: (math.isnan(metrics[s][self.best_metric]),
                                 sign * metrics[s][self.best_metric], -s))
      if self.keep_checkpoints_without_metrics:
        ranked, exempt = scored, set(unscored)
      else:
        ranked, exempt = scored + sorted(unscored, reverse=True), set()
    kept = set(ranked[:self.keep]) | exempt | {newest} | set(protected)
    if self.keep_period:
      kept |= {s for s in steps if s % self.keep_period == 0}
    return [s for s in steps if s not in kept]
