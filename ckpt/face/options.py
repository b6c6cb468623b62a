"""A Checkpointer's keyword options, checked once and turned into the
settings of its parts.

``Options`` holds the keyword arguments of ``ckpt.Checkpointer`` as given
(see its docstring for what each means); ``settings()`` checks them
(ValueError naming the argument, what it must be and what it got) and
builds what the parts take: the retention policy, the save schedule, the
save decision's options, the save and restore settings and the bounds of
the calls. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from ckpt.commit import lease as lease_lib
from ckpt.commit.retention import RetentionPolicy
from ckpt.face import decision as decision_lib
from ckpt.face import restorer as restorer_lib
from ckpt.face import rounds as rounds_lib
from ckpt.face import saver as saver_lib
from ckpt.format import root_metadata as root_metadata_lib
from ckpt.format import tsspec
from ckpt.multihost import process as multihost
from ckpt.restore import readonce
from ckpt.save import leaves as save_leaves
from ckpt.save import schedule as schedule_lib
from ckpt.shards.plan import DEFAULT_CHUNK_BYTES

DEFAULT_CONCURRENT_BYTES = 1 << 30
# Bounds of whole operations against a store that stops answering
# (ckpt/store/deadline.py): a save (and its retention pass), and a query.
DEFAULT_SAVE_TIMEOUT_S = 120.0
DEFAULT_QUERY_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the parts of one Checkpointer take, built from its options."""
  policy: RetentionPolicy
  schedule: schedule_lib.SaveSchedule
  decision: decision_lib.DecisionOptions
  save: saver_lib.SaveSettings
  restore: restorer_lib.RestoreSettings
  timeouts: rounds_lib.Timeouts
  root_metadata: str | None  # custom_metadata= as checked JSON text


@dataclasses.dataclass(frozen=True)
class Options:
  """The keyword arguments of ``ckpt.Checkpointer``, with its defaults."""
  keep: int | None = None
  keep_period: int | None = None
  best_metric: str | None = None
  best_mode: str = "min"
  keep_checkpoints_without_metrics: bool = True
  best_fn: Callable[[dict], float] | None = None
  keep_time_interval: Any = None
  keep_time_window: Any = None
  keep_steps: Any = None
  keep_period_exact: bool = True
  clock: Callable[[], Any] | None = None
  save_interval_steps: int | None = None
  save_on_steps: Any = None
  should_save_fn: Callable[[int, int | None], bool] | None = None
  save_interval_secs: Any = None
  temporary_time_saves: bool = False
  skip_while_saving: bool = False
  custom_metadata: dict | None = None
  save_dtype: Any = None
  restore_dtype: Any = None
  format: str = "zarr"  # noqa: A003 (the design's name)
  concurrent_bytes: int = DEFAULT_CONCURRENT_BYTES
  async_save: bool = True
  partitioner: Callable | None = None
  storage_options: dict | None = None
  compression: str | None = None
  chunk_checksums: bool = False
  chunk_bytes: int = DEFAULT_CHUNK_BYTES
  reuse_unchanged: bool = False
  barrier_timeout_s: float = multihost.DEFAULT_TIMEOUT_S
  lease_s: float = lease_lib.DEFAULT_LEASE_S
  read_once: bool | None = None
  save_timeout_s: float | None = DEFAULT_SAVE_TIMEOUT_S
  query_timeout_s: float | None = DEFAULT_QUERY_TIMEOUT_S
  writer: str = "thread"

  def _writer(self) -> str:
    """``writer=``, checked: what the writer process supports."""
    if self.writer not in ("thread", "process"):
      raise ValueError(f"writer must be 'thread' or 'process', got "
                       f"{self.writer!r}")
    return self.writer

  def settings(self) -> Settings:
    """The options checked, as the parts' settings."""
    clock = self.clock if self.clock is not None else time.time
    policy = RetentionPolicy(
        self.keep, self.keep_period, self.best_metric, self.best_mode,
        self.keep_checkpoints_without_metrics, best_fn=self.best_fn,
        keep_time_interval=self.keep_time_interval,
        keep_time_window=self.keep_time_window, keep_steps=self.keep_steps,
        keep_period_exact=self.keep_period_exact,
        temporary_time_saves=self.temporary_time_saves, clock=clock)
    schedule = schedule_lib.SaveSchedule.of(
        self.save_interval_steps, self.save_on_steps, self.should_save_fn)
    decision = decision_lib.DecisionOptions.of(
        self.save_interval_secs, self.skip_while_saving,
        self.temporary_time_saves)
    if int(self.concurrent_bytes) <= 0:
      raise ValueError(
          f"concurrent_bytes must be positive, got {self.concurrent_bytes}")
    if not float(self.lease_s) > 0:
      raise ValueError(f"lease_s must be positive, got {self.lease_s!r}")
    readonce.min_replicas(self.read_once, "")  # validates it
    concurrent = int(self.concurrent_bytes)
    save = saver_lib.SaveSettings(
        options=save_leaves.SaveOptions(
            storage_format=tsspec.check_format(self.format),
            codec=tsspec.Codec(self.compression, checksum=tsspec.chunk_checksum(
                self.format, self.chunk_checksums)),
            chunk_bytes=int(self.chunk_bytes), save_dtype=self.save_dtype,
            max_item_bytes=concurrent),
        concurrent_bytes=concurrent, async_save=self.async_save,
        partitioner=self.partitioner, lease_s=float(self.lease_s),
        clock=clock, writer=self._writer(),
        storage_options=self.storage_options)
    restore = restorer_lib.RestoreSettings(
        restore_dtype=self.restore_dtype, read_once=self.read_once,
        concurrent_bytes=concurrent, storage_options=self.storage_options)
    timeouts = rounds_lib.Timeouts.of(
        self.barrier_timeout_s, self.save_timeout_s, self.query_timeout_s)
    return Settings(policy, schedule, decision, save, restore, timeouts,
                    root_metadata_lib.check(self.custom_metadata))
