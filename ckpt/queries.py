"""The Checkpointer's queries and everyday calls (a mixin of Checkpointer).

In a multi-process job these are collective, like save and restore: every
process calls them, process 0 reads the directory once (``_agreed``, an
agreement round of ckpt/multihost/agreement.py), and every process gets its answer,
so all of them act on the same steps.
"""

from __future__ import annotations

import operator
from typing import Any

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

    Collective in a multi-process job: process 0 lists the directory once
    and every process gets its answer.

    Raises:
      StoreTimeoutError: the store did not answer within ``query_timeout_s``.
      CheckpointError: the directory cannot be listed.
    """
    return self._agreed("all_steps()", self._list_steps,
                        f"the steps in {self.storage.url!r}")

  def latest_step(self) -> int | None:
    """The newest committed step, or None when there is none.

    Collective, like ``all_steps`` (one agreement round); raises what it
    raises.
    """
    steps = self.all_steps()
    return steps[-1] if steps else None

  def _list_steps(self) -> list[int]:
    try:  # report the directory as retention left it
      self._wait_for_retention(deadline_lib.time_left())
    except WaitTimeoutError:  # within the query's bound: then list anyway
      pass
    return self._committed_now()

  def best_step(self) -> int | None:
    """The committed step with the best ``best_metric`` (or ``best_fn``)
    value under ``best_mode``, among the committed steps that have it; ties
    go to the newest step; NaN never counts as best. None when no committed
    step has the metric, and without ``best_metric``/``best_fn`` (Orbax
    returns ``latest_step()`` then). Collective: process 0 reads each
    step's metrics (cached, as retention's) and every process gets its
    answer.

    Raises ``StoreTimeoutError`` / ``CheckpointError`` as ``all_steps``.
    """
    return self._agreed("best_step()", self._best_step,
                        f"the best step in {self.storage.url!r}",
                        error=self._open_error())

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

    Collective: process 0 reads the step's record or index (cached), every
    process gets its answer.
    """
    return self._agreed(f"metrics({step!r})", lambda: self._read_metrics(step),
                        f"the metrics of step {step}")

  def _read_metrics(self, step: int) -> dict[str, float]:
    if step not in self._metrics_cache:
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
    directory: the first call that reaches it is a collective round (process
    0 lists the directory once, every process gets its answer); after that
    (or after any save) it is known and no call needs a round again.

    ``save_on_steps``: those steps are accepted too. ``should_save_fn(step,
    last_saved_step)``: a step it accepts is accepted too (Orbax ignores
    ``save_interval_steps`` and ``save_on_steps`` when it is given; ckpt
    takes any of them: give only ``should_save_fn`` for Orbax's behaviour,
    then without the first-step rule, as Orbax). ``last_saved_step`` is the
    step of this Checkpointer's last save, or before any the newest
    committed step (None: none), agreed on every process (one round, the
    first time it is needed). The function runs on every process, with no
    round per step: it must be deterministic (a pure function of its two
    arguments, not of the clock or of process-local state) and must not
    raise, or processes that disagree wait for each other in ``save``
    until ``barrier_timeout_s``.

    Args:
      step: the step a ``save`` would get.

    Raises:
      StoreTimeoutError: the first-step rule's one listing did not answer.
    """
    step = check_step(step)
    n, on, fn = self.save_interval_steps, self.save_on_steps, self.should_save_fn
    if n is None and on is None and fn is None:
      return True
    if ((n is not None and step % n == 0) or step == self._preemption_step
        or (on is not None and step in on)):
      return True
    if fn is not None:
      if fn(step, self._last_saved_step(step)):
        return True
      if n is None and on is None:  # as Orbax: no first-step rule with it
        return False
    if self._has_checkpoint is None:
      empty = self._agreed(
          f"should_save({step})",
          lambda: not steps_lib.committed_steps(self.storage),
          f"whether {self.storage.url!r} holds a checkpoint yet")
      if not empty:
        self._has_checkpoint = True
      return bool(empty)
    return False

  def _last_saved_step(self, step: int) -> int | None:
    """should_save_fn's ``last_saved_step``: agreed (one round the first
    time, then known from the saves)."""
    if self._last_saved is UNKNOWN:
      self._last_saved = self._agreed(
          f"should_save({step})",
          lambda: (lambda s: s[-1] if s else None)(
              steps_lib.committed_steps(self.storage)),
          f"the newest step in {self.storage.url!r}")
      if self._last_saved is not None:
        self._has_checkpoint = True
    return self._last_saved

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
    mesh, rules)`` turns it into a restore target for any mesh. Collective,
    like ``restore``: every process reads the index of the agreed step.

    Args:
      step: a committed step, or None for the latest.

    Raises:
      CheckpointNotFoundError: no such committed step (or none at all).
      CorruptCheckpointError: its index is unreadable or invalid.
    """
    step, step_dir = self._agreed(
        f"metadata({step!r})",
        lambda: [(s := restore_lib.resolve_step(self.storage, step)),
                 steps_lib.step_dir(self.storage, s)],
        f"the step of metadata() in {self.storage.url!r}",
        error=self._open_error())
    return metadata_lib.from_index(
        restore_lib.read_index(self.storage, step_dir))

  def host_state(self, step: int | None = None) -> Any:
    """This process's host_state saved with ``step`` (default: latest).

    Process 0 picks the step and reads its index once (how many processes
    saved it; whether the index holds every process's host_state itself,
    as older indexes do); then each process reads only its own file,
    ``<step>/.host_state/<process>.msgpack`` (one GET per process).

    Args:
      step: a committed step, or None for the latest.

    Raises:
      CheckpointNotFoundError: no such committed step.
      CheckpointError: the step was saved by another number of processes
        (naming both counts).

    Collective: one agreement round (process 0 picks the step), then each
    process reads its own file.
    """
    # pylint: disable=g-import-not-at-top
    from ckpt.format import index as index_lib
    from ckpt.format import seal
    from ckpt.errors import CorruptCheckpointError

    def answer() -> list:
      s = restore_lib.resolve_step(self.storage, step)
      d = steps_lib.step_dir(self.storage, s)
      index = restore_lib.read_index(self.storage, d)
      return [s, d, index.process_count, index.host_state is not None,
              index.sealed]

    step, step_dir, saved_by, inline, sealed = self._agreed(
        f"host_state({step!r})", answer,
        f"the step of host_state in {self.storage.url!r}")
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
