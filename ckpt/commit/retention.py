"""Which committed steps to delete after a save. Pure: steps, metrics, save
times and the clock in, steps out; process 0 applies the answer (stage 8)."""

from __future__ import annotations

import dataclasses
import datetime
import math
import operator
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


def _nonnegative(s: Any) -> int:
  s = operator.index(s)
  if s < 0:
    raise ValueError(f"{s} is negative")
  return s


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
  ``best_metric`` or ``best_fn``), a multiple of ``keep_period`` (or, with
  ``keep_period_exact=False``, a step ``keep_period`` steps or more after
  the last one that rule kept), one per ``keep_time_interval`` (for the
  last ``keep_time_window``), one of ``keep_steps``, the newest, or a
  protected step. With ``keep=None`` nothing is deleted by these rules.

  Best by metric with ``keep_checkpoints_without_metrics=False``: a step
  without a score is never kept by the best rule (only by the others), so
  ``keep=4`` over steps 0..4 with scores at 0, 2 and 4 keeps [0, 2, 4], as
  Orbax's ``BestN``; with True (the default) every such step is kept.

  Temporary steps (``temporary_time_saves=True``: saved only because
  ``save_interval_secs`` passed, marked so in their index): each is
  deleted once a newer step is committed (unless one of ``keep_steps`` or
  protected), whatever ``keep`` says, and no other rule counts them: the
  ``keep`` newest or best, the inexact period and the time rule look at
  the permanent steps only.

  Inexact period: the first permanent step is kept, then each permanent
  step at least ``keep_period`` steps after the last one kept (Flax's
  ``keep_every_n_steps``, Orbax's ``EveryNSteps(exact_interval=False)``).
  A step it keeps stays kept as later steps arrive and others are deleted
  (the steps before it that it depends on are ones it kept).

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
  keep_steps: frozenset[int] | None = None  # never deleted (pinned)
  keep_period_exact: bool = True
  temporary_time_saves: bool = False
  clock: Callable[[], Any] = dataclasses.field(default=time.time,
                                               compare=False)

  def __post_init__(self):
    if self.keep is not None and (type(self.keep) is not int or self.keep < 1):
      raise ValueError(f"keep must be a positive int or None, got {self.keep!r}")
    if self.keep_period is not None and (
        type(self.keep_period) is not int or self.keep_period < 1):
      raise ValueError(
          f"keep_period must be a positive int or None, got {self.keep_period!r}")
    if self.keep_steps is not None:
      try:
        pinned = frozenset(_nonnegative(s) for s in self.keep_steps)
      except (TypeError, ValueError) as e:
        raise ValueError("keep_steps must be a collection of non-negative int "
                         f"steps, got {self.keep_steps!r}: {e}") from None
      object.__setattr__(self, "keep_steps", pinned)
    for name in ("keep_period_exact", "temporary_time_saves"):
      if type(getattr(self, name)) is not bool:
        raise ValueError(f"{name} must be True or False, got "
                         f"{getattr(self, name)!r}")
    if not self.keep_period_exact and self.keep_period is None:
      raise ValueError("keep_period_exact=False needs keep_period (a step is "
                       "kept once keep_period steps passed since the last one "
                       "kept)")
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

  @property
  def deletes(self) -> bool:
    """Whether any step may ever be deleted (``keep``, or temporary steps)."""
    return self.keep is not None or self.temporary_time_saves

  def to_delete(self, steps: list[int],
                metrics: Mapping[int, Mapping[str, Any]],
                protected: frozenset[int] = frozenset(),
                times: Mapping[int, float] | None = None,
                temporary: frozenset[int] = frozenset()) -> list[int]:
    """Steps to delete. Never the newest, one of ``keep_steps``, a step the
    period or time rule keeps, or a protected step (being restored or
    written). ``times``: step -> save time in seconds since the epoch (a
    step without one is not kept by the time rule). ``temporary``: the
    steps marked temporary (ignored unless ``temporary_time_saves``)."""
    if not steps:
      return []
    steps = sorted(steps)
    newest = steps[-1]
    pinned = set(self.keep_steps or ()) | set(protected) | {newest}
    temporary = (frozenset(temporary) if self.temporary_time_saves
                 else frozenset())
    doomed = {s for s in temporary if s not in pinned}  # a newer one exists
    steps = [s for s in steps if s not in temporary]
    if self.keep is None or not steps:
      return sorted(doomed)
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
      # Without a score and not exempt: never kept by this rule (Orbax).
      ranked = scored
      exempt = set(unscored) if self.keep_checkpoints_without_metrics else set()
    kept = set(ranked[:self.keep]) | exempt | pinned
    kept |= self.kept_by_period(steps)
    kept |= self.kept_by_time(steps, times or {})
    return sorted(doomed | {s for s in steps if s not in kept})

  def kept_by_period(self, steps: list[int]) -> set[int]:
    """The steps (sorted) the ``keep_period`` rule keeps: its multiples, or
    (``keep_period_exact=False``) the first step, then each one at least
    ``keep_period`` after the last one kept."""
    n = self.keep_period
    if not n:
      return set()
    if self.keep_period_exact:
      return {s for s in steps if s % n == 0}
    kept: set[int] = set()
    last = None
    for s in steps:
      if last is None or s - last >= n:
        kept.add(s)
        last = s
    return kept

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
