"""The two-tier checkpointer: a fast local tier (ckpt/tiers/local_tier.py) in
front of a persistent ``Checkpointer``, each with its own interval and
retention; restore takes the newest step the job can rebuild from either
(see docs/multi-tier.md)."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from absl import logging

from ckpt.tiers import choice as tier_choice
from ckpt.tiers import restoring as tier_restore
from ckpt.tiers import local_leaves
from ckpt.tiers import local_tier
from ckpt.tiers import queries as tier_queries
from ckpt.tiers import saving as tier_saving
from ckpt.multihost import process as multihost
from ckpt.tiers import timeline as tier_timeline
from ckpt.checkpointer import Checkpointer
from ckpt.face.options import DEFAULT_CONCURRENT_BYTES
from ckpt.errors import WaitTimeoutError
from ckpt.restore import targets

class MultiTierCheckpointer:
  """A ``Checkpointer`` with a fast local tier in front of it.

  Args:
    persistent: the persistent tier's directory (any URL ckpt supports).
    local: a directory on each host (``/dev/shm/ckpt``, a local SSD); each
      process uses ``<local>/process_<i>/``.
    local_interval: save to the local tier every N steps.
    local_keep: local steps kept per process (>= 2).
    persistent_interval: save to the persistent tier every N steps (None:
      only forced and preemption saves).
    persistent_keep: ``keep`` of the persistent Checkpointer.
    concurrent_bytes: the host-memory budget of each tier's save.
    **checkpointer_kwargs: anything else ``ckpt.Checkpointer`` takes
      (``format``, ``keep_period``, ``keep_steps``, ``save_interval_secs``,
      ``custom_metadata`` ...), for the persistent tier; ``save_dtype`` and ``restore_dtype`` apply to the
      local tier too, as in the persistent one.
    barrier_timeout_s: how long a process waits for the others in any
      round, exchange or barrier of either tier.

  Raises:
    ValueError: an interval or ``local_keep`` that is not a positive int
      (``local_keep`` must be >= 2), or a bad ``Checkpointer`` argument.

  After a restore, ``last_restore_step``, ``last_restore_tier`` ("local"
  or "persistent") and ``last_restore_reason`` say which step it returned,
  from which tier, and why.
  """

  def __init__(self, persistent, *, local, local_interval: int = 1,
               local_keep: int = 2, persistent_interval: int | None = None,
               persistent_keep: int | None = None,
               concurrent_bytes: int = DEFAULT_CONCURRENT_BYTES,
               barrier_timeout_s: float = multihost.DEFAULT_TIMEOUT_S,
               **checkpointer_kwargs):
    for name, v in (("local_interval", local_interval),
                    ("persistent_interval", persistent_interval)):
      if v is not None and (type(v) is not int or v < 1):
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    self.local_interval = local_interval
    self.persistent_interval = persistent_interval
    self.persistent = Checkpointer(
        persistent, keep=persistent_keep, concurrent_bytes=concurrent_bytes,
        barrier_timeout_s=barrier_timeout_s, **checkpointer_kwargs)
    self.local = local_tier.LocalTier(local, keep=local_keep,
                           concurrent_bytes=concurrent_bytes,
                           barrier_timeout_s=barrier_timeout_s,
                           owner=local_tier.owner_of(self.persistent.storage.spec),
                           save_dtype=checkpointer_kwargs.get("save_dtype"),
                           restore_dtype=checkpointer_kwargs.get(
                               "restore_dtype"))
    self._timeout_s = barrier_timeout_s
    self._preemption_step: int | None = None
    self._restored: tuple[int, Any] | None = None  # (step, host_state)
    self.last_restore_tier: str | None = None
    self.last_restore_reason: str = ""
    self._restored_step: int | None = None  # (with last_restore_tier)
    self._saved_tier: str | None = None  # the tier the last save wrote last

  @property
  def last_save_stats(self) -> Any:
    """The stats of the last ``save``'s last tier: the local tier's (a dict:
    step, own_bytes, partner_bytes, blocking_s, total_s once committed),
    else the persistent tier's SaveStats. Never raises. Not collective."""
    if self._saved_tier == "local":
      return self.local.last_save_stats
    return self.persistent.last_save_stats

  @property
  def last_restore_stats(self) -> Any:
    """The stats of the last ``restore`` in ``last_restore_tier``: the local
    tier's (a dict: step, from_partner, bytes_read, total_s), else the
    persistent tier's RestoreStats. Never raises. Not collective."""
    if self.last_restore_tier == "local":
      return self.local.last_restore_stats
    return self.persistent.last_restore_stats

  @property
  def last_restore_step(self) -> int | None:
    """The step whose data the last ``restore`` returned (from
    ``last_restore_tier``); None before any. Never raises. Not collective."""
    return self._restored_step

  # -- save --

  def should_save_local(self, step: int) -> bool:
    """Whether ``save(step)`` writes to the local tier: every
    ``local_interval`` steps and the preemption step. Local, no I/O.

    Args:
      step: the step a ``save`` would get.

    Never raises. Not collective (no I/O).
    """
    return step % self.local_interval == 0 or step == self._preemption_step

  def should_save_persistent(self, step: int) -> bool:
    """``persistent_interval``, the preemption step, and the persistent
    Checkpointer's ``save_on_steps`` and ``should_save_fn`` (given to this
    class: they apply to the persistent tier; any of them saves).

    Args:
      step: the step a ``save`` would get.

    Raises as ``Checkpointer.should_save``; collective for its first-step
    round, and always with ``save_interval_secs`` or ``skip_while_saving``.
    """
    return self._persistent_verdict(step).save

  def _persistent_verdict(self, step: int, force: bool = False,
                          restart: bool = False) -> Any:
    """ckpt/tiers/saving.py ``persistent_verdict``."""
    return tier_saving.persistent_verdict(
        self.persistent, self.persistent_interval, self._preemption_step,
        step, force, restart)

  def last_saved_step(self, *, agreed: bool = True) -> int | None:
    """The persistent tier's ``last_saved_step`` (``should_save_fn``'s
    second argument).

    Args:
      agreed: as ``Checkpointer.last_saved_step``.

    Raises ``StoreTimeoutError`` as ``Checkpointer.last_saved_step``;
    collective when ``agreed`` (its first time), else any process.
    """
    return self.persistent.last_saved_step(agreed=agreed)

  def should_save(self, step: int) -> bool:
    """Whether ``save(step)`` writes ``step`` to either tier.

    Args:
      step: the step a ``save`` would get.

    Never raises; collective as ``Checkpointer.should_save`` (its
    first-step round; with ``save_interval_secs``/``skip_while_saving``).
    """
    return self.should_save_local(step) or self.should_save_persistent(step)

  @property
  def directory(self) -> Any:
    """The persistent tier's root (``Checkpointer.directory``).

    Never raises. Not collective.
    """
    return self.persistent.directory

  def save(self, step: int, state: Any, *, metrics: dict | None = None,
           transforms: Sequence[Callable] = (), host_state: Any = None,
           force: bool = False, custom_metadata: dict | None = None,
           progress: Any = None) -> bool:
    """Saves ``step`` to the tiers whose interval it hits (both with
    ``force``); returns True if any tier saved it. Collective: every
    process calls it with the same step.

    A save (of a step some tier's interval hits) of a step lower than the
    newest committed step of either tier (the persistent tier's, or a
    local step of this run the job can rebuild) is refused before anything
    is written: ``CheckpointError`` on every
    process, naming the newer steps (agreed in one round). Saving it would
    start a new timeline while the newer steps stay, and a restart would
    resume them. To roll back deliberately, ``delete(s)`` each newer step,
    then save. A step equal to the newest: the persistent tier skips it
    with a warning (as ``Checkpointer.save``), the local tier writes it
    again.

    ``custom_metadata`` (checked as ``Checkpointer.save`` does, whichever
    tier saves) is kept with the persistent tier's step only:
    ``metadata(step)`` reads the persistent tier; a step saved to the
    local tier only keeps none.

    Args:
      step: the step number, the same on every process.
      state: the PyTree to save.
      metrics: kept with the persistent tier's step (``Checkpointer.save``).
      transforms: ``fn(state_dict) -> state_dict``, applied once (in the
        timeline round: a failure on one process fails every process)
        before either tier plans the state, as ``Checkpointer.save``.
      host_state: one msgpack-able value per process, saved in both tiers.
      force: save to both tiers whatever the intervals say.
      custom_metadata: see above.
      progress: the persistent tier's save's (``Checkpointer.save``).

    Raises:
      CheckpointError: a lower step than the newest of either tier, another
        process failed before the exchange, or an earlier save failed.
      InvalidStateError: a leaf the local tier cannot store (naming it).
      BarrierTimeoutError: a peer did not arrive within ``barrier_timeout_s``.
    """
    verdict = self._persistent_verdict(step, force, restart=True)
    to_local = force or self.should_save_local(step)
    if not (verdict.save or to_local):
      return False
    return tier_saving.save(
        self.persistent, self.local, step, state, verdict, to_local,
        self._note_saved, metrics=metrics,
        transforms=transforms, host_state=host_state,
        custom_metadata=custom_metadata, progress=progress)

  def reached_preemption(self, step: int) -> bool:
    """As ``Checkpointer.reached_preemption``: True at the same step on every
    process once any was told to stop; that step is then saved to both
    tiers. Call it at every training step, before ``save``.

    Args:
      step: the current training step.

    Collective (jax's preemption sync point).

    Raises nothing of ckpt's own.
    """
    if self.persistent.reached_preemption(step):
      self._preemption_step = step
      return True
    return False

  def wait_until_finished(self, timeout: float | None = None) -> None:
    """Both tiers' saves (``Checkpointer.wait_until_finished``);
    ``timeout``: ``WaitTimeoutError`` if they are not done by then (they go
    on in the background).

    Raises the failure of either tier's background save, and
    ``WaitTimeoutError``. Not collective: each process waits for its part.
    """
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    try:
      self.persistent.wait_until_finished(timeout)
    finally:
      if deadline is not None and not self.local.finish_within(
          max(0.0, deadline - time.monotonic())):
        raise WaitTimeoutError(
            f"wait_until_finished(timeout={timeout}): the local tier's "
            f"save was not finished after {timeout} s on process "
            f"{multihost.process_index()}; it goes on in the background")
      self.local.wait()

  def is_saving_in_progress(self) -> bool:
    """True while either tier's last save is not finished (this process;
    not collective).

    Never raises.
    """
    return self.persistent.is_saving_in_progress() or self.local.running()

  def check_for_errors(self) -> None:
    """Raises a failed background save of either tier now (once), without
    waiting for a save in flight.

    Not collective: never waits, each process raises its own tier's failure.
    """
    self.persistent.check_for_errors()
    if self.local.finish_within(0):
      self.local.wait()

  def cancel(self) -> bool:
    """Abandons the persistent tier's save in flight on every process
    (``Checkpointer.cancel``: collective; its attempt is removed) and lets
    the local tier's save end (a write to a local disk; a failure of it is
    logged, not raised). True if a persistent save was cancelled."""
    try:
      return self.persistent.cancel()
    finally:
      try:
        self.local.wait()
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("ckpt: cancel(): the local tier's save failed: %s", e)

  def best_step(self) -> int | None:
    """The persistent tier's best step (``best_metric``/``best_fn`` given
    to this class; the local tier keeps no metrics). Collective.

    Raises as ``Checkpointer.best_step``.
    """
    return self.persistent.best_step()

  def root_metadata(self) -> Any:
    """The persistent tier's ``Checkpointer.root_metadata()``; raises
    what it raises. Not collective (any process)."""
    return self.persistent.root_metadata()

  def metadata(self, step: int | None = None) -> Any:
    """``Checkpointer.metadata`` of the persistent tier's ``step``
    (default: its latest), custom_metadata included. Collective.

    Args:
      step: a persistent step, or None for its latest.

    Raises as ``Checkpointer.metadata``.
    """
    return self.persistent.metadata(step)

  # -- delete --

  def delete(self, step: int) -> None:
    """Deletes ``step`` from both tiers: the persistent tier's committed
    step and every process's local ``step_<step>`` (its own part and the
    partner replica it holds). Collective; ``CheckpointNotFoundError`` if
    neither tier holds it. After it, ``latest_step()`` and a restart no
    longer see the step (a rollback: delete each newer step, then save).

    Atomic against failures: every process first renames its local step
    away, then one round, in which process 0 deletes the persistent step
    (refused for a save in flight or a step being read, as
    ``Checkpointer.delete``); if anything failed anywhere, every process
    puts its local step back and all raise the same error. If the round
    itself times out (a process died), the renamed steps stay renamed and
    go at the next save: call ``delete`` again.
    """
    tier_timeline.delete(self.persistent, self.local, step)

  # -- which step, which tier --

  def all_steps(self) -> list[int]:
    """The steps the job can restore, in increasing order: the persistent
    tier's committed steps and the local steps every process can rebuild
    (docs/multi-tier.md); ``all_steps()[-1] == latest_step()``.

    Collective (two rounds); raises what ``Checkpointer.all_steps`` raises.
    """
    return tier_queries.all_steps(self.persistent, self.local)

  def metrics(self, step: int) -> dict[str, float | int]:
    """``Checkpointer.metrics`` of the persistent tier's ``step``: the
    local tier keeps no metrics, so a step only it holds raises
    ``CheckpointNotFoundError`` (and so does a step neither holds).

    Collective, as ``Checkpointer.metrics``; raises what it raises.
    """
    return self.persistent.metrics(step)

  def reload(self) -> None:
    """``Checkpointer.reload`` of the persistent tier (the local tier
    caches nothing: it reads its manifests at every call).

    Never raises. Not collective.
    """
    self.persistent.reload()

  def latest_step(self, target: Any = None) -> int | None:
    """The newest step the job can restore from either tier (collective).

    ``target``: the step ``restore(target=target)`` returns (the local
    step only if every process can serve it on the target's shardings; it
    checks what that restore checks, the local steps' checksums included).
    Without it, the local tier's newest step counts whatever the target's
    shardings will be; it may then be newer than what ``restore`` returns
    from the persistent tier: for ``restore()`` with no target, a target
    whose shardings differ from the save's, or restore options the local
    tier does not take (``transforms``, ``fallback_state``, ``lazy=True``).
    After such a resume, the steps it set aside no longer count: this is
    the resumed step until the next save.

    Raises ``StoreTimeoutError`` / ``CheckpointError`` when the persistent
    tier cannot be listed.
    """
    leaves = [] if target is None else local_leaves.flatten(
        targets.concrete_target(target))[0]
    return tier_choice.choose(self.persistent, self.local, None,
                              leaves)["step"]

  # -- restore --

  def restore(self, step: int | None = None, *, target: Any = None,
              **restore_kwargs) -> Any:
    """Restores ``step`` (default: the newest the job can rebuild).

    From the local tier when every process has its own part of that step
    or its partner holds a replica of it, and the process count, devices
    and the target's shardings are those of the save; else from the
    persistent tier (``restore_kwargs`` go to ``Checkpointer.restore``),
    logging why. ``last_restore_step``, ``last_restore_tier`` and
    ``last_restore_reason`` say what it did. A resume (no ``step``) that
    passes over newer local steps says so in one WARNING and sets them
    aside: no query, restore or save refusal of this job sees them again,
    and the next local save removes them (docs/multi-tier.md).

    Restore options the local tier does not take (``transforms``,
    ``fallback_state``, ``lazy=True``) choose among the persistent tier's
    steps only: its newest, or ``step`` if it holds it (a step only the
    local tier holds raises ``CheckpointNotFoundError`` naming both).
    ``verify=True`` and ``read_once`` do not restrict the choice: the
    local tier checks every shard's crc32c on every restore.
    ``restore(path=...)`` reads that checkpoint through the persistent
    tier's Checkpointer.

    Args:
      step: a step of either tier, or None for the newest the job can rebuild.
      target: as ``Checkpointer.restore``'s (the local tier needs one).
      **restore_kwargs: any other ``Checkpointer.restore`` option.

    Raises:
      CheckpointNotFoundError: neither tier holds the step (naming both).
      TreeMismatchError: the target does not fit the saved leaves (the same
        error and message a ``Checkpointer`` raises), on every process.
      CheckpointError: another process failed (naming it), or what
        ``Checkpointer.restore`` raises.

    Collective: one agreement round picks the step and the tier on every
    process.
    """
    return tier_restore.restore(self.persistent, self.local,
                                self._note_restored, step, target,
                                restore_kwargs)

  def restore_async(self, step: int | None = None, *, target: Any = None,
                    **restore_kwargs) -> Any:
    """``restore`` whose reads run while the caller goes on, as
    ``Checkpointer.restore_async``: the step and tier are agreed now (one
    round). From the persistent tier the reads start on its background
    loop and ``result()`` finishes them; from the local tier, whose reads
    end in an exchange with partner hosts (a collective on this thread),
    the restore is done before it returns (``result()`` returns it).

    Args:
      step: as ``restore``.
      target: as ``restore``.
      **restore_kwargs: as ``restore``.

    Raises what ``restore`` raises (from the call, or from ``result()``).
    Collective, as ``restore``.
    """
    return tier_restore.restore(self.persistent, self.local,
                                self._note_restored, step, target,
                                restore_kwargs, start=True)

  def _note_saved(self, tier: str) -> None:
    self._saved_tier = tier

  def _note_restored(self, tier: str, step, reason: str, restored) -> None:
    self.last_restore_tier, self.last_restore_reason = tier, reason
    self._restored_step, self._restored = step, restored

  def host_state(self, step: int | None = None) -> Any:
    """This process's host_state of the step restored last (or of ``step``
    in the persistent tier).

    Args:
      step: None (the step restored last), or a step of the persistent tier.

    Raises ``CheckpointNotFoundError`` for a step the persistent tier does
    not hold. Collective, as ``Checkpointer.host_state``.
    """
    if self._restored is not None and step in (None, self._restored[0]):
      return self._restored[1]
    return self.persistent.host_state(step)

  # -- lifecycle --

  def close(self) -> None:
    """Waits for both tiers' saves, then closes them (as
    ``Checkpointer.close``, whose errors it raises).

    Collective when a save is in flight.
    """
    try:
      self.wait_until_finished()
    finally:
      self.persistent.close()
      self.local.close()

  def __enter__(self) -> "MultiTierCheckpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

