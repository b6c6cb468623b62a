"""The public Checkpointer.

Concurrency model (the only one in ckpt): the API is synchronous; inside,
one asyncio event loop runs on one background thread owned by the
Checkpointer (ckpt/face/loop.py). Every TensorStore call, barrier and
retention step of a save runs there. At most one save is in flight
(ckpt/face/inflight.py): ``save`` first waits for the previous one's commit
(not for its retention). ``save`` returns when its data is staged on the
host (async mode) or when it is committed (``async_save=False``). A failure
on the background thread is stored and re-raised by the next ``save``,
``wait_until_finished`` or ``close``.

Every collective call (save, restore, restore_async, delete, cancel)
starts, on the caller's thread, with one agreement round
(ckpt/multihost/agreement.py); the read-only queries are not collective.
Built from parts that own their state (ckpt/face/: BackgroundLoop,
InFlightSave, KnownSteps, Retention, SaveHistory, Rounds, Saver, Restorer,
Queries, SaveDecision, RootMetadataFile, SaveCall; built and wired in
ckpt/face/parts.py) to which each public method hands its call; the options
are in ckpt/face/options.py. ``tier_side`` (ckpt/face/tier_side.py) is what
a MultiTierCheckpointer asks of the Checkpointer that is its persistent tier.

The read-only queries (``all_steps``, ``latest_step``, ``best_step``,
``metrics``, ``metadata``, ``host_state``, ``should_save``) may be called by
any process, alone or with others: each reads the directory itself (within
``query_timeout_s``), with no agreement round, so "log from rank 0" code
never leaves the other processes waiting. ``delete`` is collective.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

from ckpt import metadata as metadata_lib
from ckpt.commit import lease as lease_lib
from ckpt.multihost import process as multihost
from ckpt.face import options as options_lib
from ckpt.face import parts as parts_lib
from ckpt.face import root_meta
from ckpt.restore import handle as handle_lib
from ckpt.restore import job as job_lib
from ckpt.shards.plan import DEFAULT_CHUNK_BYTES
from ckpt.face.options import (DEFAULT_CONCURRENT_BYTES,
                               DEFAULT_QUERY_TIMEOUT_S, DEFAULT_SAVE_TIMEOUT_S)


class Checkpointer:
  """Saves and restores sharded JAX PyTrees under one directory.

  Args:
    directory: a path, ``file://``, ``gs://``, ``s3://`` or ``memory://`` URL.
    keep, keep_period, best_metric, best_mode, keep_checkpoints_without_metrics:
      the retention policy applied after each commit (see RetentionPolicy).
    best_fn: ``fn(metrics) -> float`` ranked by ``best_mode`` instead of one
      ``best_metric`` (a KeyError in it: the step has no score).
    keep_time_interval, keep_time_window: also keep one step per interval
      (seconds or timedelta) for the last window (None: forever), e.g.
      ``3600, 86400``: one per hour for the last day.
    keep_steps: steps never deleted (Orbax's ``CustomSteps``).
    keep_period_exact: False: ``keep_period`` keeps a step once that many
      steps passed since the last one it kept (Flax's keep_every_n_steps).
    clock: "now" for the time rules and the save time written in the index
      (``time.time`` by default; injectable for tests).
    save_interval_steps: ``save`` writes only the steps ``should_save``
      accepts (every N-th, the first, the preemption step); None: every
      step it is given.
    save_on_steps: a collection of steps ``should_save`` always accepts
      (with or without ``save_interval_steps``).
    should_save_fn: ``fn(step, last_saved_step) -> bool`` (Orbax's
      signature), asked besides the two above; a pure function of its
      arguments (it runs on every process): see ``should_save``.
    save_interval_secs: also save once this many seconds (or a timedelta)
      passed since the last save: process 0's clock decides, every process
      saves the same steps (``should_save`` is then collective).
    temporary_time_saves: a step saved only by ``save_interval_secs`` is
      deleted once a newer step commits (Levanter's temporary checkpoints).
    skip_while_saving: ``save`` returns False at once while the previous
      save is still writing (process 0's, agreed; Orbax's continuous
      checkpointing); forced and preemption saves wait for it instead.
    custom_metadata: a JSON-able dict for the whole directory (at most 64
      KiB), written once by its first save; see ``root_metadata()``.
    save_dtype / restore_dtype: cast floating leaves before writing / after
      reading (e.g. ``"bfloat16"``).
    format: ``"zarr"`` (v2), ``"zarr3"`` or ``"ocdbt"`` (zarr3 inside OCDBT:
      few files per step; each process writes its own database and process 0
      merges them at finalize, see docs/object-stores.md).
    concurrent_bytes: one host-memory budget for data in flight (staged and
      being written, or being read) in a save or restore.
    async_save: ``save`` returns once device data is staged on the host.
    partitioner: for host numpy leaves, ``fn(path, shape) -> Sharding|None``
      (see ``ckpt.MeshPartitioner``); None means replicated.
    storage_options: merged into the TensorStore kvstore spec (endpoint,
      region, request concurrency and retries...; see docs/object-stores.md for the
      environment variables read without it).
    compression: None (raw chunks) or ``"zstd"``.
    chunk_checksums: formats "zarr3"/"ocdbt": every chunk carries zarr3's
      crc32c codec, checked by TensorStore as it decodes (about 2x restore
      time). Default False: each chunk's crc32c is recorded at save and
      every restore checks what it reads (``restore(verify=...)``).
    chunk_bytes: target size of one stored chunk.
    reuse_unchanged: unchanged chunks are hard-linked (disk) or their leaf
      held by an earlier step (bucket), not written; two consecutive steps
      hold two copies unless ``keep=1`` (docs/format.md).
    barrier_timeout_s: how long a process waits for the others at a barrier.
      Every coordination call is bounded by it (docs/multi-host.md):
      a process 0 that stops answering (frozen, stopped, dead) makes the
      others raise ``BarrierTimeoutError`` naming it within this + 5 s.
    save_timeout_s: the longest a save may go without progress (no
      request completing; waits at barriers do not count), not its length:
      a slow but steady store commits a save of any size. Past it the save
      fails on every process with ``StoreTimeoutError`` saying what stalled
      and for how long (docs/multi-host.md). Also bounds each retention
      pass and ``delete``. None: only TensorStore's retries of each request.
    query_timeout_s: the same bound for the queries, the choice of a
      restore's step, opening the store, and the reads of ``restore`` and
      of lazy leaves.
    lease_s: a save renews its lease every ``lease_s / 6`` seconds; cleanup
      removes an uncommitted attempt whose lease went unrenewed this long,
      or at once when its holder is provably dead (docs/multi-host.md).
    read_once: restore onto a mesh with data-parallel replicas reads each
      box from storage once, spread over the replica processes, and
      exchanges the parts with an all-gather (docs/read-once.md). True: on,
      False: off, None (default): automatic, on for object stores (s3://,
      gs://) when a leaf has 2 or more replica processes, off for a local
      disk or memory:// (see docs/benchmarks.md, "Read once", for the measurements).
      ``restore(read_once=...)`` overrides it for one call.
    writer: ``"thread"`` (default) writes from a thread of this process;
      ``"process"`` hands each staged save to a writer process of this host
      through shared memory; the writers commit it even if the training
      processes die once ``save()`` returned (docs/writer-process.md).
  """

  def __init__(self, directory: str | os.PathLike, *,
               keep: int | None = None, keep_period: int | None = None,
               best_metric: str | None = None, best_mode: str = "min",
               keep_checkpoints_without_metrics: bool = True,
               best_fn: Callable[[dict], float] | None = None,
               keep_time_interval: Any = None, keep_time_window: Any = None,
               keep_steps: Any = None, keep_period_exact: bool = True,
               clock: Callable[[], Any] | None = None,
               save_interval_steps: int | None = None,
               save_on_steps: Any = None,
               should_save_fn: Callable[[int, int | None], bool] | None = None,
               save_interval_secs: Any = None,
               temporary_time_saves: bool = False,
               skip_while_saving: bool = False,
               custom_metadata: dict | None = None,
               save_dtype: Any = None, restore_dtype: Any = None,
               format: str = "zarr",  # noqa: A002 (the design's name)
               concurrent_bytes: int = DEFAULT_CONCURRENT_BYTES,
               async_save: bool = True, partitioner: Callable | None = None,
               storage_options: dict | None = None,
               compression: str | None = None,
               chunk_checksums: bool = False,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               reuse_unchanged: bool = False,
               barrier_timeout_s: float = multihost.DEFAULT_TIMEOUT_S,
               lease_s: float = lease_lib.DEFAULT_LEASE_S,
               read_once: bool | None = None,
               save_timeout_s: float | None = DEFAULT_SAVE_TIMEOUT_S,
               query_timeout_s: float | None = DEFAULT_QUERY_TIMEOUT_S,
               writer: str = "thread"):
    given = {k: v for k, v in locals().items()
             if k not in ("self", "directory")}  # every keyword, as given
    options = options_lib.Options(**given)
    settings = options.settings()
    self.policy, self.schedule = settings.policy, settings.schedule
    self.save_interval_steps = self.schedule.interval  # Orbax's attributes
    self.save_on_steps = self.schedule.on_steps
    self.should_save_fn = self.schedule.fn
    timeouts, save = settings.timeouts, settings.save
    # The options as given (Orbax's attributes; read, not changed, here).
    self.restore_dtype, self.read_once = restore_dtype, read_once
    self.concurrent_bytes = save.concurrent_bytes
    self.async_save, self.partitioner = async_save, partitioner
    self.barrier_timeout_s, self.lease_s = barrier_timeout_s, save.lease_s
    self.save_timeout_s, self.query_timeout_s = timeouts.save_s, timeouts.query_s
    # What this Checkpointer's cleanups saw of other attempts' leases (the
    # clock that dates them on object stores: ckpt/commit/lease.py).
    self.lease_seen = lease_lib.Sightings()
    # The parts (ckpt/face/), each the owner of its state.
    parts = parts_lib.Parts.build(directory, options, settings, self.close,
                                  lambda: self.lease_seen)
    self.storage = parts.storage
    self._rounds, self._inflight = parts.rounds, parts.inflight
    self._known, self._history = parts.known, parts.history
    self._loop, self._retention = parts.loop, parts.retention
    self._root_metadata, self._saver = parts.root_metadata, parts.saver
    self._restorer, self._queries = parts.restorer, parts.queries
    self._save_call = parts.save_call
    # What a MultiTierCheckpointer whose persistent tier this is asks of
    # it besides the public calls (ckpt/face/tier_side.py); not a user's.
    self.tier_side = parts.tier_side

  @property
  def last_save_stats(self) -> Any:
    """What this process did in the last ``save`` (a SaveStats: the step,
    the bytes and boxes written, the seconds of each stage; ``skipped``
    for a step not saved). Never raises. Not collective (no I/O)."""
    return self._saver.last_save_stats

  @property
  def last_restore_stats(self) -> Any:
    """What the last ``restore`` did on this process (a RestoreStats: the
    bytes read and fetched, the seconds of each stage). Never raises. Not
    collective (no I/O)."""
    return self._restorer.last_restore_stats

  @property
  def last_restore_step(self) -> int | None:
    """The step whose data the last ``restore`` returned (a resume may
    have fallen back past a damaged step); None before any. Never raises.
    Not collective (no I/O)."""
    return self._restorer.last_restore_step

  # ---- save -------------------------------------------------------------

  def save(self, step: int, state: Any, *, metrics: dict | None = None,
           transforms: Sequence[Callable] = (), host_state: Any = None,
           force: bool = False, custom_metadata: dict | None = None,
           progress: Any = None) -> bool:
    """Saves ``state`` as ``step``; returns False if the step is the newest
    committed one (with a warning) or (with ``save_interval_steps``)
    ``should_save(step)`` is False.

    A step lower than the newest committed step (committed itself or not)
    is refused before anything is written: ``CheckpointError`` naming the
    newer steps, on every process. Saving it would start a new timeline
    while the newer steps stay, and ``latest_step()``/``restore()`` (a
    restarted job) would resume them, not it. To roll back deliberately,
    ``delete(s)`` each newer step, then save.

    In a multi-process job every process calls it with the same step. The
    processes agree before anything is written (docs/multi-host.md): all
    save, or all skip a committed step, or all raise the same error naming
    the process that could not prepare its part and why.

    Args:
      step: the step number (an int >= 0), the same on every process.
      state: the PyTree to save.
      metrics: numbers (ints stay ints), nested dicts flattened to ``a/b``
        names; kept with the step, ranked by ``best_metric``.
      transforms: ``fn(state_dict) -> state_dict`` applied, in order, to the
        state (nested dicts keyed by path parts) before it is planned.
      host_state: one msgpack-able value per process, stored in this
        process's own file; read back by ``host_state(step)``.
      force: save even if ``should_save(step)`` is False.
      custom_metadata: a dict JSON holds exactly, at most 1 MiB as JSON, in
        the step's index (``metadata(step).custom_metadata``; process 0's).
      progress: True (a tqdm bar) or ``fn(done_bytes, total_bytes)`` called
        on the background thread as this process writes (docs/everyday.md).

    Raises:
      CheckpointError: a lower step than the newest committed one, another
        process failed to prepare, or the previous background save failed
        (re-raised here); with ``async_save=False`` any failure of this save.
      InvalidStateError: a leaf that cannot be saved, a per-host value saved
        as a job-wide one, bad metrics or custom_metadata (naming where).
      BarrierTimeoutError: a process did not arrive within
        ``barrier_timeout_s``.

    Collective: every process of the job calls it, in the same order as its
    other collective calls.
    """
    return self._save_call.save(
        step, state, lambda: self._queries.decide(
            step, agreed=True, force=force, restart=True),
        dict(metrics=metrics, transforms=transforms, host_state=host_state,
             custom_metadata=custom_metadata, progress=progress))

  def wait_until_finished(self, timeout: float | None = None) -> None:
    """Blocks until the in-flight save is committed and its retention (the
    deletion of steps the policy drops, process 0) is done; re-raises a
    failure of the save.

    ``timeout`` (seconds): raise ``WaitTimeoutError`` if that is not done
    by then; the save is not cancelled and stays tracked. Not collective:
    each process waits for its own part.
    """
    if timeout is not None and not float(timeout) >= 0:
      raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    self._inflight.wait(timeout)
    self._retention.wait(
        None if deadline is None else max(0.0, deadline - time.monotonic()),
        timeout)

  def check_for_errors(self) -> None:
    """Raises the failure of the last background save now, if it has
    failed; returns at once otherwise (a save still in flight, or none).
    Never waits. The failure is raised once, by whichever of this,
    ``wait_until_finished``, the next ``save`` or ``close`` comes first.
    Not collective: each process checks its own save (all processes'
    saves fail together: the failure travels with the save's barriers)."""
    self._inflight.check()

  def cancel(self) -> bool:
    """Abandons the save in flight on every process and removes its
    attempt; returns True once that is done everywhere, False if no save
    was in flight (or it had committed: then it stays committed).

    For a job that must exit now. Collective: every process calls it.
    Each process stops its part of the save (requests already sent to the
    store end first); then one round, in which process 0
    removes the attempt (its uncommitted work directory and pending record)
    unless the step committed meanwhile; every process returns the same
    answer. The save's failure is not raised (it was cancelled); the
    Checkpointer takes the next save as usual. Retention of an earlier
    save goes on (``wait_until_finished`` waits for it).
    """
    cancelled = self._inflight.cancel(self._loop, self._rounds, self.storage,
                                      self.lease_s)
    self._known.forget_newest()
    if cancelled:
      self._history.forget()  # the step was not saved
    return cancelled

  def is_saving_in_progress(self) -> bool:
    """True while the last save is not yet committed (or failed) on this
    process; its retention does not count. Not collective (no I/O): each
    process answers for itself.

    Never raises.
    """
    return self._inflight.running()

  # ---- restore ----------------------------------------------------------

  def restore(self, step: int | None = None, *, target: Any = None,
              path: str | None = None, transforms: Sequence[Callable] = (),
              fallback_state: Any = None, lazy: bool = False,
              verify: bool = True, read_once: Any = "default",
              progress: Any = None) -> Any:
    """Restores ``step`` (default: latest) or the checkpoint at ``path``.

    Args:
      target: a PyTree of ``jax.ShapeDtypeStruct`` (with ``.sharding``) or
        arrays saying where each leaf goes; None returns host numpy values
        (typed PRNG keys come back as key arrays on the default device).
        A ShapeDtypeStruct without a sharding (``jax.eval_shape``) restores
        the leaf as a jax.Array in its saved sharding (or raises
        TreeMismatchError naming it; see restore.AsSaved); a numpy array
        leaf restores as numpy.
        A target that is a subset of the saved tree restores that subset;
        checkpoint leaves it does not want are never read.
      transforms: ``fn(ckpt_tree, target_tree, *, is_resuming) -> ckpt_tree``
        over nested dicts keyed by path parts whose array leaves are lazy
        (see ``ckpt.transforms``). ``is_resuming`` is True when this restores
        the Checkpointer's own latest step (resuming a job), False when it
        initialises from ``path=`` or an earlier step.
      fallback_state: a PyTree like ``target`` that supplies leaves the
        checkpoint (after transforms) does not have.
      lazy: return LazyLeaf objects bound to the target's sharding and dtype;
        ``leaf.read()`` (or ``await leaf.read_async()``) reads them later.
      verify: check every stored chunk this process reads against the
        crc32c recorded at save, as its bytes arrive (no second read; the
        default; False opts out). A mismatch in an explicit ``step`` (or a
        ``path``) raises CorruptCheckpointError naming the leaf, the box,
        the chunk file, the expected and the found checksum; a resume
        (``step=None``) whose newest step fails falls back, on every process
        alike, to the newest step that verifies, with one WARNING naming
        what failed (``last_restore_step`` says which step came back).
      read_once: True / False / None (automatic) for this call (default:
        the Checkpointer's). With it, the processes that hold the same box
        of a leaf each read a distinct part of it in whole stored chunks
        and exchange the parts with a collective on this thread, in batches
        within ``concurrent_bytes`` (docs/read-once.md). Every process must
        pass the same value (checked). With ``lazy=True`` such a leaf's
        ``read()`` is a collective call (every process reads the same
        leaves in the same order). ``last_restore_stats`` says what it did.
      progress: True (a tqdm bar) or ``fn(done_bytes, total_bytes)`` called
        on the background thread as this process reads (docs/everyday.md).

    In a multi-process job every process calls it; process 0 picks the step
    (the latest, or checks that all asked for the same one) and every
    process restores that step.
    """
    return self._restorer.start(job_lib.RestoreRequest(
        step, target, path, transforms, fallback_state, lazy, verify,
        read_once, progress)).result()

  def restore_async(self, step: int | None = None, *, target: Any = None,
                    path: str | None = None,
                    transforms: Sequence[Callable] = (),
                    fallback_state: Any = None, lazy: bool = False,
                    verify: bool = True, read_once: Any = "default",
                    progress: Any = None) -> "handle_lib.RestoreHandle":
    """``restore`` whose reads run while the caller goes on (compiling its
    train step, say): agrees on the step now (one round), starts the reads
    on the background loop and returns a handle at once, with ``done()``
    and ``result(timeout=None)``. ``result()`` runs the rest on the
    caller's thread (the outcome rounds, the read-once exchange, a resume's
    fallback) and returns what ``restore`` returns, or raises what it
    raises, on every process alike.

    The same arguments as ``restore`` (``target``, ``path``, ``transforms``,
    ``fallback_state``, ``lazy``, ``verify``, ``read_once``, ``progress``;
    see ``restore``
    for raises). Collective like ``restore``: every
    process calls it, and its ``result()``, in the same order as its other
    collective calls. Until ``result()`` has returned or raised, a
    ``save``, ``restore`` or ``restore_async`` is refused
    (``CheckpointError`` naming the restore in flight, before anything is
    written or agreed); ``close()`` cancels the reads (``result()`` then
    raises ``CheckpointError``).
    """
    return self._restorer.start(job_lib.RestoreRequest(
        step, target, path, transforms, fallback_state, lazy, verify,
        read_once, progress))

  # ---- queries ----------------------------------------------------------

  @property
  def directory(self) -> Any:
    """The checkpoint root: an ``etils.epath.Path`` for a local directory
    (a path or ``file://`` URL, made absolute), as Orbax's
    ``CheckpointManager.directory``; the URL string for ``gs://``, ``s3://``
    and ``memory://`` (ckpt reads those with TensorStore, not epath).

    Never raises. Not collective (no I/O).
    """
    # pylint: disable=g-import-not-at-top
    from etils import epath
    url = self.storage.url
    if self.storage.is_posix:
      path = url[len("file://"):] if url.startswith("file://") else url
      return epath.Path(os.path.abspath(path))
    return url

  def all_steps(self) -> list[int]:
    """The committed steps of the directory, in increasing order.

    Any process, alone or with others: it lists the directory itself (on
    process 0, once its retention pass after the last save is done).
    Not collective.

    Raises:
      StoreTimeoutError: the store did not answer within ``query_timeout_s``.
      CheckpointError: the directory cannot be listed.
    """
    return self._queries.all_steps()

  def latest_step(self) -> int | None:
    """The newest committed step, or None when there is none.

    Any process, like ``all_steps``; raises what it raises. Not collective.
    """
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """The committed step with the best ``best_metric`` (or ``best_fn``)
    value under ``best_mode``, among the committed steps that have it; ties
    go to the newest step; NaN never counts as best. None when no committed
    step has the metric, and without ``best_metric``/``best_fn`` (Orbax
    returns ``latest_step()`` then). Any process: it reads each step's
    metrics itself (cached, as retention's). Not collective.

    Raises ``StoreTimeoutError`` / ``CheckpointError`` as ``all_steps``.
    """
    return self._queries.best_step()

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
    return self._queries.metrics(step)

  def reload(self) -> None:
    """Forgets what this Checkpointer cached about saved steps (their
    metrics and save times), so the next query reads them from the
    directory again: after another job changed it. No I/O; safe to call on
    any process.

    Never raises. Not collective.
    """
    self._queries.forget()

  def root_metadata(self) -> "root_meta.RootMetadata":
    """The directory's root metadata: ``.custom_metadata``, the dict given
    as ``Checkpointer(custom_metadata=...)`` by the run that first saved
    into it (written once, by process 0, with that first save; sealed;
    never deleted by retention). Before any save wrote it, the dict this
    Checkpointer was given ({} if none). A reopen with another dict keeps
    the stored one (one WARNING at its first save). Any process: it reads
    the file itself. Not collective.

    Raises:
      CorruptCheckpointError: the file is damaged (its crc32c, its JSON).
      StoreTimeoutError: the store did not answer within ``query_timeout_s``.
    """
    return self._rounds.local(self._root_metadata.current)

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

    ``save_interval_secs`` / ``skip_while_saving``: a step the rules above
    refuse is accepted once that many seconds passed since the last save,
    and any step is refused while the previous save is still writing
    (never the preemption step); both decided by process 0 (its clock, its
    save in flight) in one agreement round, so with either option this
    call is collective: every process calls it, as it calls ``save``. It
    does not restart the interval (``save`` does). Without any rule but
    ``save_interval_secs`` there is no first-step save (as Levanter: the
    interval runs from when the Checkpointer was made).

    Args:
      step: the step a ``save`` would get.

    Raises:
      StoreTimeoutError: the first-step rule's one listing did not answer.
    """
    return self._queries.should_save(step, agreed=False)

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
    return self._queries.last_saved_step(agreed)

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
    self._queries.delete(step)

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
    return metadata_lib.from_index(self._queries.index(step))

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
    return self._queries.host_state(step)

  # ---- preemption -------------------------------------------------------

  def reached_preemption(self, step: int) -> bool:
    """Call at every training step; True at the step to save on preemption.

    All processes get True at the same step after any of them is told to
    stop (SIGTERM or the cluster's preemption notice); ``should_save`` is
    then True for that step whatever ``save_interval_steps`` says. So::

      if ckptr.reached_preemption(step):
        ckptr.save(step, state)
        ckptr.wait_until_finished()
        sys.exit(0)

    Args:
      step: the current training step, the same on every process.

    Raises nothing of ckpt's own. Collective in a multi-process job (jax's
    preemption sync point: call it at every step on every process).
    """
    if multihost.reached_preemption_sync_point(step):
      self._queries.note_preemption(step)  # should_save(step) is True
      return True
    return False

  # ---- lifecycle --------------------------------------------------------

  def close(self) -> None:
    """Waits for the save in flight and its retention, then stops the
    background thread. Idempotent; ``with Checkpointer(...)`` calls it.

    Raises:
      CheckpointError (or its subclasses): the last background save failed
        and its error was not raised yet.

    Collective when a save is in flight (it waits at that save's barriers).
    """
    def before_stop():
      self._restorer.cancel_pending("close() was called before its result()")
      self.wait_until_finished()
    self._loop.close(before_stop)
    self._saver.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
