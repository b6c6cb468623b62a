"""The Checkpointer's queries and everyday calls (a mixin of Checkpointer).

The read-only queries (``all_steps``, ``latest_step``, ``best_step``,
``metrics``, ``metadata``, ``host_state``, ``should_save``) may be called by
any process, alone or with others: each reads the directory itself (within
``query_timeout_s``), with no agreement round, so "log from rank 0" code
never leaves the other processes waiting. Every process sees the same
committed steps, except a step committed or deleted while it asks (a save
or a retention pass in flight on process 0). ``delete`` is collective:
process 0 deletes, in an agreement round (ckpt/multihost/agreement.py).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

from ckpt.commit import steps as steps_lib
from ckpt.store import deadline as deadline_lib
from ckpt import metadata as metadata_lib
from ckpt.multihost import process as multihost
from ckpt.commit import records
from ckpt.restore import read as restore_lib
from ckpt.format import extras as save_extras
from ckpt.errors import CheckpointError, WaitTimeoutError


# The Checkpointer's newest committed step before a listing (process 0).
UNKNOWN = object()


class Queries:
  """What a Checkpointer answers about its directory; uses its
  ``storage``, ``_agreed``, ``_retention``, ``_lock``, caches and in-flight
  save."""

  def all_steps(self) -> list[int]:
    """The committed steps of the directory, in increasing order.

    Any process, alone or with others: it lists the directory itself (on
    process 0, once its retention pass after the last save is done).
    Not collective.

    Raises:
      StoreTimeoutError: the store did not answer within ``query_timeout_s``.
      CheckpointError: the directory cannot be listed.
    """
    return self._local(self._list_steps)

  def latest_step(self) -> int | None:
    """The newest committed step, or None when there is none.

    Any process, like ``all_steps``; raises what it raises. Not collective.
    """
    steps = self.all_steps()
    return steps[-1] if steps else None

  def _local(self, answer: Callable[[], Any]) -> Any:
    """``answer()`` on this process alone, within ``query_timeout_s``
    (also after ``close()``: it only reads)."""
    return deadline_lib.call(self._query_deadline(), answer)

  def _list_steps(self) -> list[int]:
    # Report the directory as retention left it after the last save.
    if multihost.process_index() == 0:
      try:
        self._wait_for_retention(deadline_lib.time_left())
      except WaitTimeoutError:  # within the query's bound: then list anyway
        pass
      return self._committed_now()
    last = self._committed_save
    if (self.policy.keep is not None and last is not None and
        last != self._retained):
      # Process 0 signals when its pass after that save is done.
      left = deadline_lib.time_left()
      if multihost.await_announced(self._retained_key(last),
                                60.0 if left is None else left):
        self._retained = last
    return steps_lib.committed_steps(self.storage)

  def _retained_key(self, step: int) -> str:
    return f"{self._key_base}/retained/{step}"

  def _retention_done(self, step: int) -> None:
    """Process 0, after the retention pass that followed ``step``'s save."""
    previous, self._retained = self._retained, step
    multihost.announce(self._retained_key(step),
                     None if previous is None else self._retained_key(previous))

  def best_step(self) -> int | None:
    """The committed step with the best ``best_metric`` (or ``best_fn``)
    value under ``best_mode``, among the committed steps that have it; ties
    go to the newest step; NaN never counts as best. None when no committed
    step has the metric, and without ``best_metric``/``best_fn`` (Orbax
    returns ``latest_step()`` then). Any process: it reads each step's
    metrics itself (cached, as retention's). Not collective.

    Raises ``StoreTimeoutError`` / ``CheckpointError`` as ``all_steps``.
    """
    return self._local(self._best_step)

  def _best_step(self) -> int | None:
    if not self.policy.ranks_by_metrics:
      return None
    scores = {}
    for s in self._list_steps():
      try:
        score = self.policy.score(self._read_metrics(s))
      except CheckpointError:  # deleted meanwhile, unreadable: no score
        continue
      if score is not None and score == score:  # not NaN
        scores[s] = score
    if not scores:
      return None
    sign = 1.0 if self.policy.best_mode == "min" else -1.0
    return min(scores, key=lambda s: (sign * scores[s], -s))

  def metrics(self, step: int) -> dict[str, float | int]:
    """The metrics saved with ``step``: ``{"a/b": number}``, ints as ints.

    Args:
      step: a committed step.

    Raises:
      CheckpointNotFoundError: ``step`` is not committed (a save in flight is
        not: ``wait_until_finished()`` first).
      StoreTimeoutError: the store did not answer within ``query_timeout_s``.

    Any process: it reads the step's record or index itself (cached).
    Not collective.
    """
    return self._local(lambda: self._read_metrics(step))

  def _read_metrics(self, step: int) -> dict[str, float]:
    if step not in self._metrics_cache:
      if (multihost.process_index() != 0 and
          not steps_lib.is_committed(self.storage, step)):
        raise steps_lib.not_committed(self.storage, step)
      self._read_step_info(step)
    return dict(self._metrics_cache[step])

  def _read_time(self, step: int) -> float:
    """The save time recorded in ``step``'s index (the time rule)."""
    if step not in self._time_cache:
      self._read_step_info(step)
    return self._time_cache[step]

  def _read_step_info(self, step: int) -> None:
    """Process 0 (or one process alone): the step's metrics and save time,
    from its commit record on an object store (one GET), else its index."""
    info = records.read_info(self.storage, step)
    if info is not None and info[1] is not None:
      self._metrics_cache[step], self._time_cache[step] = info
      return
    index = restore_lib.read_index(self.storage,
                                   steps_lib.step_dir(self.storage, step))
    self._metrics_cache[step] = dict(index.metrics)
    self._time_cache[step] = index.time

  def reload(self) -> None:
    """Forgets what this Checkpointer cached about saved steps (their
    metrics and save times), so the next query reads them from the
    directory again: after another job changed it. No I/O; safe to call on
    any process.

    Never raises. Not collective.
    """
    self._metrics_cache.clear()
    self._time_cache.clear()
    self._newest = self._after_commit = UNKNOWN
    self._last_saved = UNKNOWN

  def should_save(self, step: int) -> bool:
    """Whether ``save(step, ...)`` writes ``step`` (``save_interval_steps``).

    True for every step without ``save_interval_steps``; with it, for
    multiples of it (step 0 included), for the step ``reached_preemption``
    said True for, and for the first step of a run whose directory holds no
    checkpoint yet (as Orbax's CheckpointManager). The first two are pure
    functions of the step and of jax's agreed preemption step, so every
    process computes the same answer with no I/O. The third needs the
    directory: the first call that reaches it lists it (on the calling
    process); after that (or after any save) it is known. Any process may
    call it; ``save`` itself agrees on whether to save. Not collective.

    ``save_on_steps``: those steps are accepted too. ``should_save_fn(step,
    last_saved_step)``: a step it accepts is accepted too (Orbax ignores
    ``save_interval_steps`` and ``save_on_steps`` when it is given; ckpt
    takes any of them: give only ``should_save_fn`` for Orbax's behaviour,
    then without the first-step rule, as Orbax). ``last_saved_step`` is the
    step of this Checkpointer's last save, or before any the newest
    committed step (None: none; listed the first time it is needed). The
    function runs on every process that calls, with no round: it must be
    deterministic (a pure function of its two
    arguments, not of the clock or of process-local state) and must not
    raise, or processes that disagree wait for each other in ``save``
    until ``barrier_timeout_s``.

    Args:
      step: the step a ``save`` would get.

    Raises:
      StoreTimeoutError: the first-step rule's one listing did not answer.
    """
    return self._should_save(step, agreed=False)

  def _should_save(self, step: int, agreed: bool) -> bool:
    """should_save; ``agreed`` (``save``'s own decision): the directory
    facts come from agreement rounds and are kept, so every process takes
    the same decision; else this process lists the directory itself and
    keeps nothing it learnt alone."""
    step = check_step(step)

    def ask(what: str, fn: Callable[[], Any]) -> Any:
      if agreed:
        return self._agreed(f"should_save({step})", fn, what)
      return self._local(fn)
    sched = self.schedule
    if sched.every_step:
      return True
    if sched.by_rule(step, self._preemption_step):
      return True
    if sched.fn is not None:
      if sched.fn(step, self._last_saved_step(ask, agreed)):
        return True
      if sched.interval is None and sched.on_steps is None:
        return False  # as Orbax: no first-step rule with it
    if self._has_checkpoint is None:
      empty = ask(f"whether {self.storage.url!r} holds a checkpoint yet",
                  lambda: not steps_lib.committed_steps(self.storage))
      if not empty and agreed:
        self._has_checkpoint = True
      return bool(empty)
    return False

  def last_saved_step(self, *, agreed: bool = True) -> int | None:
    """``should_save_fn``'s ``last_saved_step``: the step of this
    Checkpointer's last save, or before any the newest committed step
    (None: none).

    Args:
      agreed: True: the first time it is needed, process 0 lists the
        directory in one agreement round (collective) and every process
        keeps the answer; False: this process lists it (any process).

    Raises:
      StoreTimeoutError: the listing did not answer within ``query_timeout_s``.
    """
    def ask(what: str, fn: Callable[[], Any]) -> Any:
      if agreed:
        return self._agreed("last_saved_step()", fn, what)
      return self._local(fn)
    return self._last_saved_step(ask, agreed)

  def _last_saved_step(self, ask, agreed: bool) -> int | None:
    """should_save_fn's ``last_saved_step``: listed the first time (kept
    when agreed), then known from the saves."""
    if self._last_saved is not UNKNOWN:
      return self._last_saved
    last = ask(f"the newest step in {self.storage.url!r}",
               lambda: (lambda s: s[-1] if s else None)(
                   steps_lib.committed_steps(self.storage)))
    if agreed:
      self._last_saved = last
      if last is not None:
        self._has_checkpoint = True
    return last

  def delete(self, step: int) -> None:
    """Deletes the committed ``step``, atomically (readers see it whole or
    not at all, as retention's deletions).

    Refused (``CheckpointError``) for the step of a save still in flight
    (``wait_until_finished()`` first) and for a step being restored or
    read by live ``restore(lazy=True)`` leaves; ``CheckpointNotFoundError``
    if it is not committed. Unlike retention it may delete the newest step.
    Collective: process 0 decides and deletes, every process gets the same
    result or error.

    Args:
      step: the committed step to delete.

    Raises:
      CheckpointError: a save of ``step`` in flight, or the step being read.
      CheckpointNotFoundError: ``step`` is not committed.
    """
    given, error = step, self._open_error()
    try:  # a failure on one process fails the round on all
      step = check_step(step)
    except ValueError as e:
      error = error or e
    self._agreed(f"delete({given!r})", lambda: self._delete_step(step),
                 f"the deletion of step {given!r} in {self.storage.url!r}",
                 error=error)
    self._metrics_cache.pop(step, None)
    self._time_cache.pop(step, None)
    self._last_saved = UNKNOWN  # (it may have been the step deleted)

  def _delete_step(self, step: int) -> bool:
    """Process 0, in the delete round: within ``save_timeout_s`` (a step
    of many keys may take longer than a query)."""
    with self._lock:
      fut, saving = self._inflight, self._inflight_step
    if fut is not None and saving == step and not fut.done():
      raise CheckpointError(
          f"cannot delete step {step} in {self.storage.url!r}: it is being "
          "saved (call wait_until_finished() first)")
    with deadline_lib.scope(self._save_deadline(step, "deleting step {} from")):
      try:
        self._retention.delete(step)
      finally:  # it may have been the newest: list again to know
        self._newest = UNKNOWN
    return True

  def metadata(self, step: int | None = None) -> "metadata_lib.Metadata":
    """What ``step`` (default: latest) holds, without reading its data.

    ``.tree`` is the saved tree with a ``jax.ShapeDtypeStruct`` (the saved
    dtype, no sharding) per array leaf and the inline values as saved;
    ``.shardings`` holds each array's saved sharding by leaf path (a
    ``SavedSharding``: mesh axis names and sizes, PartitionSpec,
    ``.to_sharding(devices=None)``); also
    ``.step``, ``.time``, ``.metrics``. ``ckpt.abstract_target(metadata,
    mesh, rules)`` turns it into a restore target for any mesh. Any
    process: it picks the step and reads its index itself. Not collective.

    Args:
      step: a committed step, or None for the latest.

    Raises:
      CheckpointNotFoundError: no such committed step (or none at all).
      CorruptCheckpointError: its index is unreadable or invalid.
    """
    def answer():
      s = restore_lib.resolve_step(self.storage, step)
      return metadata_lib.from_index(restore_lib.read_index(
          self.storage, steps_lib.step_dir(self.storage, s)))
    return self._local(answer)

  def host_state(self, step: int | None = None) -> Any:
    """This process's host_state saved with ``step`` (default: latest).

    The calling process picks the step and reads its index (how many
    processes' host_state it holds; whether the index holds every process's
    host_state itself, as older indexes do), then its own file,
    ``<step>/.host_state/<process>.msgpack``. A step saved without
    host_state (None on every process; an import of an Orbax step without
    per-process items) holds none: None, on any number of processes.

    Args:
      step: a committed step, or None for the latest.

    Raises:
      CheckpointNotFoundError: no such committed step.
      CheckpointError: the step holds host_state for another number of
        processes (naming both counts).

    Any process (each reads its own part; with ``step=None`` each asks
    for the newest step itself: pass ``last_restore_step`` to read the
    step a restore returned). Not collective.
    """
    # pylint: disable=g-import-not-at-top
    from ckpt.format import index as index_lib
    from ckpt.format import seal
    from ckpt.errors import CorruptCheckpointError

    def answer() -> list:
      s = restore_lib.resolve_step(self.storage, step)
      d = steps_lib.step_dir(self.storage, s)
      index = restore_lib.read_index(self.storage, d)
      saved_by = (index.process_count if index.host_states is None else
                  index.host_states)  # (None: an index from before it)
      return [s, d, saved_by, index.host_state is not None, index.sealed]

    step, step_dir, saved_by, inline, sealed = self._local(answer)
    if saved_by == 0:  # a step without per-process state
      return None
    n, pid = multihost.process_count(), multihost.process_index()

    def mismatch(count: int) -> CheckpointError:
      return CheckpointError(
          f"step {step} holds host_state for {count} processes "
          f"but this job has {n}; host_state is per process and cannot be "
          "mapped onto a different process count")

    if saved_by != n:
      raise mismatch(saved_by)
    if inline:  # an older index: every process's host_state is in it
      index = restore_lib.read_index(self.storage, step_dir)
      if len(index.host_state or ()) != n:
        raise mismatch(len(index.host_state or ()))
      return save_extras.unpack_host_state(index.host_state[pid])
    rel = index_lib.process_file(index_lib.HOST_STATE_DIR, pid, step_dir)
    where = f"{self.storage.url.rstrip('/')}/{rel}"
    data = self.storage.read_bytes(rel, limit=index_lib.MAX_PROCESS_FILE_BYTES)
    if data is None:
      raise CorruptCheckpointError(
          f"step {step}: the host_state of process {pid} ({where}) is "
          "missing; the checkpoint is incomplete (every process writes its "
          "file before the step is committed)")
    return save_extras.unpack_host_state(
        seal.maybe_unseal(data, where, sealed), where)


def check_step(step: Any) -> int:
  given = step
  try:
    step = operator.index(step)
  except TypeError:
    step = -1
  if step < 0:
    raise ValueError(f"step must be a non-negative int, got {given!r}")
  return step
