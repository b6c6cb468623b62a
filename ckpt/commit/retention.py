"""Which committed steps to delete after a save. Pure: steps, metrics, save
times and the clock in, steps out; process 0 applies the answer (stage 8)."""

from __future__ import annotations

import dataclasses
import datetime
import math
import time
from typing import Any, Callable, Mapping


def seconds(value: Any, name: str) -> float | None:
  """A duration given as seconds or a ``datetime.timedelta``; None stays None."""
  if value is None:
    return None
  if isinstance(value, datetime.timedelta):
    value = value.total_seconds()
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      value > 0 and math.isfinite(value)):
    raise ValueError(f"{name} must be a positive number of seconds or a "
                     f"timedelta, or None; got {value!r}")
  return float(value)


def now_s(clock: Callable[[], Any]) -> float:
  """``clock()`` as seconds since the epoch (it may return a float or an
  aware ``datetime``, as Levanter's ``dt_now_injection`` does)."""
  t = clock()
  if isinstance(t, datetime.datetime):
    return t.timestamp()
  return float(t)


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
  """Which steps survive; see Checkpointer for the options.

  A step is kept when any rule keeps it: the ``keep`` newest (or best, by
  ``best_metric`` or ``best_fn``), a multiple of ``keep_period``, one per
  ``keep_time_interval`` (for the last ``keep_time_window``), the newest,
  or a protected step. With ``keep=None`` nothing is deleted.

  Time rule: save times fall into fixed buckets of ``keep_time_interval``
  seconds since the epoch; the oldest step of each bucket is kept while it
  is younger than ``keep_time_window`` (None: forever). A step it keeps
  stays kept as later steps arrive or others are deleted (it depends on
  no other step of its bucket being older, and they only go away).
  ``clock`` gives "now" (injectable for tests, as Levanter's
  ``dt_now_injection``).
  """
  keep: int | None = None
  keep_period: int | None = None
  best_metric: str | None = None
  best_mode: str = "min"
  keep_checkpoints_without_metrics: bool = True
  best_fn: Callable[[Mapping[str, Any]], float] | None = None
  keep_time_interval: Any = None   # seconds or timedelta
  keep_time_window: Any = None     # seconds or timedelta; None: forever
  clock: Callable[[], Any] = dataclasses.field(default=time.time,
                                               compare=False)

  def __post_init__(self):
    if self.keep is not None and (type(self.keep) is not int or self.keep < 1):
      raise ValueError(f"keep must be a positive int or None, got {self.keep!r}")
    if self.keep_period is not None and (
        type(self.keep_period) is not int or self.keep_period < 1):
      raise ValueError(
          f"keep_period must be a positive int or None, got {self.keep_period!r}")
    if self.best_mode not in ("min", "max"):
      raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
    if self.best_fn is not None and not callable(self.best_fn):
      raise ValueError(f"best_fn must be a callable metrics -> float, got "
                       f"{self.best_fn!r}")
    if self.best_fn is not None and self.best_metric is not None:
      raise ValueError("give best_metric or best_fn, not both (got "
                       f"best_metric={self.best_metric!r} and a best_fn)")
    object.__setattr__(self, "keep_time_interval", seconds(
        self.keep_time_interval, "keep_time_interval"))
    object.__setattr__(self, "keep_time_window", seconds(
        self.keep_time_window, "keep_time_window"))
    if self.keep_time_window is not None and self.keep_time_interval is None:
      raise ValueError("keep_time_window needs keep_time_interval (one step "
                       f"per interval is kept for that window); got "
                       f"keep_time_window={self.keep_time_window!r} alone")

  @property
  def ranks_by_metrics(self) -> bool:
    return self.best_metric is not None or self.best_fn is not None

  @property
  def uses_times(self) -> bool:
    return self.keep_time_interval is not None

  def score(self, metrics: Mapping[str, Any] | None) -> float | None:
    """The value ``best_mode`` ranks by, or None when the step has none (no
    ``best_metric`` among its metrics; ``best_fn`` raised KeyError)."""
    metrics = metrics or {}
    if self.best_fn is not None:
      if not metrics:
        return None
      try:
        return float(self.best_fn(metrics))
      except KeyError:
        return None
    if self.best_metric in metrics:
      return float(metrics[self.best_metric])
    return None

  def to_delete(self, steps: list[int],
                metrics: Mapping[int, Mapping[str, Any]],
                protected: frozenset[int] = frozenset(),
                times: Mapping[int, float] | None = None) -> list[int]:
    """Steps to delete. Never the newest, a ``keep_period`` multiple, a
    step the time rule keeps, or a protected step (being restored or
    written). ``times``: step -> save time in seconds since the epoch (a
    step without one is not kept by the time rule)."""
    if self.keep is None or not steps:
      return []
    steps = sorted(steps)
    newest = steps[-1]
    if not self.ranks_by_metrics:
      ranked = sorted(steps, reverse=True)
      exempt: set[int] = set()
    else:
      scores = {s: self.score(metrics.get(s)) for s in steps}
      scored = [s for s in steps if scores[s] is not None]
      unscored = [s for s in steps if scores[s] is None]
      sign = 1.0 if self.best_mode == "min" else -1.0
      # NaN (a diverged run) ranks worst: it compares false with everything
      # and would otherwise scramble the order.
      scored.sort(key=lambda s: (math.isnan(scores[s]), sign * scores[s], -s))
      if self.keep_checkpoints_without_metrics:
        ranked, exempt = scored, set(unscored)
      else:
        ranked, exempt = scored + sorted(unscored, reverse=True), set()
    kept = set(ranked[:self.keep]) | exempt | {newest} | set(protected)
    if self.keep_period:
      kept |= {s for s in steps if s % self.keep_period == 0}
    kept |= self.kept_by_time(steps, times or {})
    return [s for s in steps if s not in kept]

  def kept_by_time(self, steps: list[int], times: Mapping[int, float]
                   ) -> set[int]:
    """The steps the time rule keeps (see the class docstring)."""
    if self.keep_time_interval is None:
      return set()
    now = now_s(self.clock)
    first: dict[int, tuple[float, int]] = {}
    for s in steps:
      t = times.get(s)
      if t is None or not math.isfinite(t):
        continue
      bucket = math.floor(t / self.keep_time_interval)
      if bucket not in first or (t, s) < first[bucket]:
        first[bucket] = (t, s)
    window = self.keep_time_window
    return {s for t, s in first.values() if window is None or now - t < window}
