"""The queries of a Checkpointer, and ``delete``.

``Queries`` answers what ``Checkpointer``'s read-only queries ask
(``all_steps``, ``latest_step``, ``best_step``, ``metrics``, ``metadata``,
``host_state``, ``should_save``, ``last_saved_step``): each may be called by
any process, alone or with others, and reads the directory itself (within
``query_timeout_s``), with no agreement round, so "log from rank 0" code never
leaves the other processes waiting. Every process sees the same committed
steps, except a step committed or deleted while it asks (a save or a
retention pass in flight on process 0). ``delete`` is collective: process 0
deletes, in an agreement round (ckpt/multihost/agreement.py). It owns the
agreed preemption step; what is known of the steps is ``KnownSteps``', of
the saves ``SaveHistory``'s, and the deletions are ``Retention``'s.
"""

from __future__ import annotations

from typing import Any, Callable

from ckpt.multihost import posts as posts_lib
from ckpt.commit import steps as steps_lib
from ckpt.commit.retention import RetentionPolicy
from ckpt.face import decision as decision_lib
from ckpt.face import inflight as inflight_lib
from ckpt.face import history as history_lib
from ckpt.face import known as known_lib
from ckpt.face import loop as loop_lib
from ckpt.face import retention as retention_lib
from ckpt.face import rounds as rounds_lib
from ckpt.format import extras as save_extras
from ckpt.format import index as index_lib
from ckpt.format import seal
from ckpt.multihost import process as multihost
from ckpt.restore import read as restore_lib
from ckpt.save import schedule as schedule_lib
from ckpt.store import deadline as deadline_lib
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError, CorruptCheckpointError

class Queries:
  """What a Checkpointer answers about its directory (see the module
  docstring)."""

  def __init__(self, storage: storage_lib.Storage, policy: RetentionPolicy,
               schedule: schedule_lib.SaveSchedule,
               known: known_lib.KnownSteps,
               retention: retention_lib.Retention,
               history: history_lib.SaveHistory, rounds: rounds_lib.Rounds,
               inflight: inflight_lib.InFlightSave,
               loop: loop_lib.BackgroundLoop,
               decision: decision_lib.SaveDecision):
    self.storage = storage
    self._decision = decision
    self.policy = policy
    self.schedule = schedule
    self._known = known
    self._retention = retention
    self._history = history
    self._rounds = rounds
    self._inflight = inflight
    self._loop = loop
    # The step reached_preemption said True for (agreed: jax's sync point).
    self._preemption_step: int | None = None

  def all_steps(self) -> list[int]:
    return self._rounds.local(self.list_steps)

  def list_steps(self) -> list[int]:
    """The committed steps, as retention left them after the last save
    (within the query bound of the caller)."""
    self._retention.settle()
    if multihost.process_index() == 0:
      return self._known.committed_now(self._inflight.step_running(),
                                       self._retention.damaged())
    return steps_lib.committed_steps(self.storage)

  def best_step(self) -> int | None:
    def best() -> int | None:
      if not self.policy.ranks_by_metrics:
        return None
      return known_lib.scored(self.policy, self.list_steps(),
                              self._known.read_metrics)
    return self._rounds.local(best)

  def metrics(self, step: int) -> dict[str, float | int]:
    return self._rounds.local(lambda: self._known.read_metrics(step))

  def note_preemption(self, step: int) -> None:
    """``reached_preemption`` said True for ``step``: it is saved."""
    self._preemption_step = step

  def should_save(self, step: int, agreed: bool) -> bool:
    """should_save (see ``decide``)."""
    return self.decide(step, agreed).save

  def decide(self, step: int, agreed: bool, force: bool = False,
             restart: bool = False) -> decision_lib.Verdict:
    """Whether to save ``step``: the step rules, then process 0's clock and
    save in flight (ckpt/face/decision.py: one agreed round whenever
    ``save_interval_secs`` or ``skip_while_saving`` is set). ``agreed`` (``save``'s own decision):
    the directory facts of the step rules come from agreement rounds and
    are kept, so every process takes the same decision; else this process
    lists the directory itself and keeps nothing it learnt alone.
    ``force``: saved whatever the rules say (never skipped); ``restart``:
    a save's decision (ckpt/face/decision.py)."""
    step = posts_lib.check_step(step)
    by_steps = force or self._by_steps(step, agreed)
    return self.verdict(step, by_steps, force, restart)

  def verdict(self, step: int, by_steps: bool, force: bool = False,
              restart: bool = False) -> decision_lib.Verdict:
    """The decision past the step rules (``by_steps``: they accept it):
    process 0's clock and save in flight, agreed (ckpt/face/decision.py);
    the preemption step, like a forced one, is never skipped."""
    return self._decision.decide(
        step, by_steps, force or step == self._preemption_step,
        self._asker(f"should_save({step})", True), restart)

  def _by_steps(self, step: int, agreed: bool) -> bool:
    """The step rules (``save_interval_steps``, ``save_on_steps``,
    ``should_save_fn``, the first step, the preemption step)."""
    sched = self.schedule
    if sched.every_step:
      return not self._decision.options.interval_s  # time alone: no step
    if sched.by_rule(step, self._preemption_step):
      return True
    ask = self._asker(f"should_save({step})", agreed)
    if sched.fn is not None:
      if sched.fn(step, self._last_saved_step(ask, agreed)):
        return True
      if sched.interval is None and sched.on_steps is None:
        return False  # as Orbax: no first-step rule with it
    if self._history.has_checkpoint is None:
      empty = ask(f"whether {self.storage.url!r} holds a checkpoint yet",
                  lambda: not steps_lib.committed_steps(self.storage))
      if not empty and agreed:
        self._history.agreed_not_empty()
      return bool(empty)
    return False

  def last_saved_step(self, agreed: bool) -> int | None:
    return self._last_saved_step(self._asker("last_saved_step()", agreed),
                                 agreed)

  def _asker(self, request: str, agreed: bool
             ) -> Callable[[str, Callable[[], Any]], Any]:
    """How a question of ``request`` is asked: in a read round (agreed),
    or by this process alone."""
    def ask(what: str, fn: Callable[[], Any]) -> Any:
      if agreed:
        return self._rounds.agreed(request, fn, what)
      return self._rounds.local(fn)
    return ask

  def _last_saved_step(self, ask, agreed: bool) -> int | None:
    """should_save_fn's ``last_saved_step``: listed the first time (kept
    when agreed), then known from the saves."""
    history = self._history
    if history.last_saved is not history_lib.UNKNOWN:
      return history.last_saved
    last = ask(f"the newest step in {self.storage.url!r}",
               lambda: (lambda s: s[-1] if s else None)(
                   steps_lib.committed_steps(self.storage)))
    if agreed:
      history.agreed_last_saved(last)
    return last

  def delete(self, step: int) -> None:
    """The body of ``Checkpointer.delete`` (see its docstring)."""
    given = step
    # A failure on one process fails the round on all.
    error = posts_lib.failure_of(
        lambda: (self._loop.check_open(), posts_lib.check_step(step)))
    if error is None:
      step = posts_lib.check_step(step)
    self._rounds.agreed(
        f"delete({given!r})", lambda: self.delete_now(step),
        f"the deletion of step {given!r} in {self.storage.url!r}",
        error=error)
    self.deleted(step)

  def delete_now(self, step: int) -> bool:
    """Process 0, in a delete round (within the query bound, as the
    round's answer): deletes ``step`` within ``save_timeout_s`` (a step of
    many keys may take longer than a query); refused for the step of the
    save in flight."""
    if self._inflight.step_running() == step:
      raise CheckpointError(
          f"cannot delete step {step} in {self.storage.url!r}: it is being "
          "saved (call wait_until_finished() first)")
    with deadline_lib.scope(self._rounds.save_deadline(
        step, "deleting step {} from")):
      try:
        self._retention.delete(step)
      finally:  # it may have been the newest: list again to know
        self._known.forget_newest()
    return True

  def forget(self) -> None:
    """``Checkpointer.reload``: nothing cached is trusted any more."""
    self._known.forget()
    self._history.forget()

  def deleted(self, step: int) -> None:
    """Every process, once the round deleted ``step``."""
    self._known.deleted(step)
    self._history.forget()  # (it may have been the step deleted)

  def index(self, step: int | None) -> index_lib.Index:
    """The index of ``step`` (default: latest), read by this process."""
    def answer():
      s = restore_lib.resolve_step(self.storage, step)
      return restore_lib.read_index(self.storage,
                                    steps_lib.step_dir(self.storage, s))
    return self._rounds.local(answer)

  def host_state(self, step: int | None) -> Any:
    """The body of ``Checkpointer.host_state`` (see its docstring)."""
    def answer() -> list:
      s = restore_lib.resolve_step(self.storage, step)
      d = steps_lib.step_dir(self.storage, s)
      index = restore_lib.read_index(self.storage, d)
      saved_by = (index.process_count if index.host_states is None else
                  index.host_states)  # (None: an index from before it)
      return [s, d, saved_by, index.host_state is not None, index.sealed]

    step, step_dir, saved_by, inline, sealed = self._rounds.local(answer)
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
