"""The public Checkpointer.

Concurrency model (the only one in ckpt): the API is synchronous; inside,
one asyncio event loop runs on one background thread owned by the
Checkpointer. Every TensorStore call, barrier and retention step of a save
runs there. At most one save is in flight: ``save`` first waits for the
previous one's commit (not for its retention). ``save`` returns when its
data is staged on the host (async mode) or when it is committed
(``async_save=False``). A failure on the background thread is stored and
re-raised by the next ``save``, ``wait_until_finished`` or ``close``.

Every collective call (save, restore and the queries) starts, on the
caller's thread, with one agreement round through the coordination service
(ckpt/multihost/agreement.py), so that all processes take the same decision; the
stages after it are in ckpt/save/runner.py and the commit protocol in
ckpt/commit/protocol.py.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import hashlib
import json
import os
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from absl import logging

from ckpt.multihost import agreement
from ckpt.commit import protocol as commit_lib
from ckpt.commit import steps as steps_lib
from ckpt.commit import cleanup as cleanup_lib
from ckpt.store import deadline as deadline_lib
from ckpt.save import runner as finalize
from ckpt.multihost import process as multihost
from ckpt.save import plan_cache
from ckpt.save import polite
from ckpt import queries
from ckpt.restore import readonce
from ckpt.commit import records
from ckpt.store import storemeter
from ckpt.restore import read as restore_lib
from ckpt.save import write as save_lib
from ckpt.format import extras as save_extras
from ckpt.store import storage as storage_lib
from ckpt.format import tree
from ckpt.format import tsspec
from ckpt.errors import CheckpointError, WaitTimeoutError
from ckpt.shards.plan import DEFAULT_CHUNK_BYTES
from ckpt.commit.retention import RetentionPolicy

DEFAULT_CONCURRENT_BYTES = 1 << 30
_UNKNOWN = queries.UNKNOWN  # Checkpointer._newest before a listing
# Bounds of whole operations against a store that stops answering
# (ckpt/store/deadline.py): a save (and its retention pass), and a query.
DEFAULT_SAVE_TIMEOUT_S = 120.0
DEFAULT_QUERY_TIMEOUT_S = 60.0


def _chunk_checksum(fmt: str, on: bool) -> str | None:
  if not on:
    return None
  if fmt == "zarr":
    raise ValueError("chunk_checksums=True needs format 'zarr3' or 'ocdbt' "
                     "(zarr v2 has no checksum codec); got format 'zarr'")
  return "crc32c"


class Checkpointer(queries.Queries):
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
    clock: "now" for the time rule and the save time written in the index
      (``time.time`` by default; injectable for tests).
    save_interval_steps: ``save`` writes only the steps ``should_save``
      accepts (every N-th, the first, the preemption step); None: every
      step it is given.
    save_on_steps: a collection of steps ``should_save`` always accepts
      (with or without ``save_interval_steps``).
    should_save_fn: ``fn(step, last_saved_step) -> bool`` (Orbax's
      signature; ``last_saved_step`` None before any), asked by
      ``should_save`` besides the two above: a step is saved if any of
      them accepts it. It runs on every process and must give the same
      answer on each (a pure function of its arguments): see
      ``should_save``.
    save_dtype / restore_dtype: cast floating leaves before writing / after
      reading (e.g. ``"bfloat16"``).
    format: ``"zarr"`` (v2), ``"zarr3"`` or ``"ocdbt"`` (zarr3 inside OCDBT:
      few files per step; each process writes its own database and process 0
      merges them at finalize, see ckpt/store/ocdbt.py).
    concurrent_bytes: one host-memory budget for data in flight (staged and
      being written, or being read) in a save or restore.
    async_save: ``save`` returns once device data is staged on the host.
    partitioner: for host numpy leaves, ``fn(path, shape) -> Sharding|None``
      (see ``ckpt.MeshPartitioner``); None means replicated.
    storage_options: merged into the TensorStore kvstore spec (endpoint,
      region, request concurrency and retries...; see ckpt/store/storage.py for the
      environment variables read without it).
    compression: None (raw chunks) or ``"zstd"``.
    chunk_checksums: formats "zarr3"/"ocdbt": every chunk carries zarr3's
      crc32c codec, which TensorStore checks on every read (restores are
      verified with no ``verify=True``, at a cost: about 2x restore time with
      64 MiB raw chunks). Default False: boxes are checksummed at save into
      per-process files, checked by ``verify`` and ``restore(verify=True)``.
    chunk_bytes: target size of one stored chunk.
    barrier_timeout_s: how long a process waits for the others at a barrier.
    save_timeout_s: a save that is not committed this many seconds after it
      started writing (process 0: when it prepares the attempt) fails with
      ``StoreTimeoutError`` naming the step, the URL and this option,
      re-raised by ``wait_until_finished``/``close``/the next ``save``, on
      every process (the failure travels with the "written" barrier). The
      bound covers the whole save: every request, the commit and the
      removal of the failed attempt (cut short at the deadline; its
      ``pending/`` record then stays for cleanup). Requests in flight at the
      deadline are abandoned, not cancelled (ckpt/store/tsfuture.py). Also bounds
      each retention pass and ``delete``. None: no bound but TensorStore's
      retries of each request (ckpt/store/storage.py).
    query_timeout_s: the same bound for the directory queries:
      ``latest_step``, ``all_steps``, ``metrics``, ``metadata``,
      ``host_state``'s choice of step, ``should_save``'s first round,
      ``restore``'s choice of step (not its reads of data), and opening the
      store when the Checkpointer is made.
    lease_s: a save renews its lease every ``lease_s / 6`` seconds (at
      most once a second on an object store); cleanup (process 0, at every
      save) removes an uncommitted attempt once its lease is older than this,
      or at once when its holder is provably dead (see ckpt/commit/lease.py).
    read_once: restore onto a mesh with data-parallel replicas reads each
      box from storage once, spread over the replica processes, and
      exchanges the parts with an all-gather (ckpt/restore/readonce.py). True: on,
      False: off, None (default): automatic, on for object stores (s3://,
      gs://) when a leaf has 2 or more replica processes, off for a local
      disk or memory:// (see docs/benchmarks.md, "Read once", for the measurements).
      ``restore(read_once=...)`` overrides it for one call.
  """

  def __init__(self, directory: str | os.PathLike, *,
               keep: int | None = None, keep_period: int | None = None,
               best_metric: str | None = None, best_mode: str = "min",
               keep_checkpoints_without_metrics: bool = True,
               best_fn: Callable[[dict], float] | None = None,
               keep_time_interval: Any = None, keep_time_window: Any = None,
               clock: Callable[[], Any] | None = None,
               save_interval_steps: int | None = None,
               save_on_steps: Any = None,
               should_save_fn: Callable[[int, int | None], bool] | None = None,
               save_dtype: Any = None, restore_dtype: Any = None,
               format: str = "zarr",  # noqa: A002 (the design's name)
               concurrent_bytes: int = DEFAULT_CONCURRENT_BYTES,
               async_save: bool = True, partitioner: Callable | None = None,
               storage_options: dict | None = None,
               compression: str | None = None,
               chunk_checksums: bool = False,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               barrier_timeout_s: float = multihost.DEFAULT_TIMEOUT_S,
               lease_s: float = commit_lib.DEFAULT_LEASE_S,
               read_once: bool | None = None,
               save_timeout_s: float | None = DEFAULT_SAVE_TIMEOUT_S,
               query_timeout_s: float | None = DEFAULT_QUERY_TIMEOUT_S):
    self._clock = clock if clock is not None else time.time
    self.policy = RetentionPolicy(
        keep, keep_period, best_metric, best_mode,
        keep_checkpoints_without_metrics, best_fn=best_fn,
        keep_time_interval=keep_time_interval,
        keep_time_window=keep_time_window, clock=self._clock)
    if save_interval_steps is not None and (
        type(save_interval_steps) is not int or save_interval_steps < 1):
      raise ValueError("save_interval_steps must be a positive int or None, "
                       f"got {save_interval_steps!r}")
    self.save_interval_steps = save_interval_steps
    if save_on_steps is not None:
      try:
        save_on_steps = frozenset(queries.check_step(s) for s in save_on_steps)
      except (TypeError, ValueError) as e:
        raise ValueError("save_on_steps must be a collection of non-negative "
                         f"int steps, got {save_on_steps!r}: {e}") from None
    self.save_on_steps = save_on_steps
    if should_save_fn is not None and not callable(should_save_fn):
      raise ValueError("should_save_fn must be a callable (step, "
                       f"last_saved_step) -> bool, got {should_save_fn!r}")
    self.should_save_fn = should_save_fn
    # The step of the last save of this Checkpointer (agreed: saves are
    # collective), or the newest committed one before it; should_save_fn's
    # second argument. _UNKNOWN until asked.
    self._last_saved: Any = _UNKNOWN
    # The attempt of the save in flight (cancel() removes it).
    self._attempt: finalize.Attempt | None = None
    self._task: asyncio.Task | None = None
    # Agreed facts the skip decision of save() rests on, the same on every
    # process: the step reached_preemption said True for, and whether the
    # directory holds a checkpoint (None: not asked yet).
    self._preemption_step: int | None = None
    self._has_checkpoint: bool | None = None
    if int(concurrent_bytes) <= 0:
      raise ValueError(f"concurrent_bytes must be positive, got {concurrent_bytes}")
    self._options = save_lib.SaveOptions(
        storage_format=tsspec.check_format(format),
        codec=tsspec.Codec(compression, checksum=_chunk_checksum(
            format, chunk_checksums)), chunk_bytes=int(chunk_bytes),
        save_dtype=save_dtype, max_item_bytes=int(concurrent_bytes))
    self.restore_dtype = restore_dtype
    readonce.min_replicas(read_once, "")  # validates it
    self.read_once = read_once
    self.last_restore_stats = readonce.RestoreStats()
    self.concurrent_bytes = int(concurrent_bytes)
    self.async_save = async_save
    self.partitioner = partitioner
    # The last save's plan, reused while the state keeps its layout.
    self._plan_cache = plan_cache.PlanCache()
    self.barrier_timeout_s = barrier_timeout_s
    self._readonce_key: str | None = None  # the last read-once restore's
    # The rounds of read-once lazy leaves' reads (made at the first
    # multi-process restore(lazy=True) with read once on).
    self._lazy_rounds: readonce.LazyRounds | None = None
    if not float(lease_s) > 0:
      raise ValueError(f"lease_s must be positive, got {lease_s!r}")
    self.lease_s = float(lease_s)
    self._storage_options = storage_options
    self.save_timeout_s = deadline_lib.check_bound("save_timeout_s",
                                                   save_timeout_s)
    self.query_timeout_s = deadline_lib.check_bound("query_timeout_s",
                                                    query_timeout_s)
    self.storage = deadline_lib.call(
        self._query_deadline(), storage_lib.Storage, directory,
        storage_options)
    self._context = self.storage.context()
    # Coordination keys name the directory, so every process derives the
    # same ones from what it was given (see multihost.call_key).
    self._key_base = "dir-" + hashlib.sha1(json.dumps(
        self.storage.spec, sort_keys=True).encode()).hexdigest()[:16]
    self._metrics_cache: dict[int, dict[str, float]] = {}
    self._time_cache: dict[int, float] = {}
    self._lock = threading.Lock()
    self._inflight: concurrent.futures.Future | None = None
    self._inflight_step: int | None = None
    # Process 0: the newest committed step (-1: none; _UNKNOWN: list to
    # know), and what it will be once the save in flight commits; a save's
    # refusal of a lower step rests on them (see _newest_bound).
    self._newest: Any = _UNKNOWN
    self._after_commit: Any = _UNKNOWN
    self._retention = finalize.Retention(self.storage, self.policy,
                                         self._read_metrics, self._read_time,
                                         timeout_s=self.save_timeout_s)
    self.last_save_stats = save_lib.SaveStats()
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=_run_loop, args=(self._loop,),
                                    name="ckpt-background", daemon=True)
    self._thread.start()
    self._closed = False
    # A job that ends without close() still finishes (commits) its last save.
    # It must run before the interpreter stops thread pools (asyncio.to_thread
    # refuses work after that), which plain atexit handlers do not.
    concurrent.futures.ThreadPoolExecutor  # pylint: disable=pointless-statement
    # (imports the pool module now, so its exit hook is older and runs after)
    getattr(threading, "_register_atexit", atexit.register)(
        _close_at_exit, weakref.ref(self))

  # ---- save -------------------------------------------------------------

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

  def save(self, step: int, state: Any, *, metrics: dict | None = None,
           transforms: Sequence[Callable] = (), host_state: Any = None,
           force: bool = False, custom_metadata: dict | None = None) -> bool:
    """Saves ``state`` as ``step``; returns False if the step is the newest
    committed one (with a warning) or (with ``save_interval_steps``)
    ``should_save(step)`` is False.

    A step lower than the newest committed step (committed itself or not)
    is refused before anything is written: ``CheckpointError`` naming the
    newer steps, on every process. Saving it would start a new timeline
    while the newer steps stay, and ``latest_step()``/``restore()`` (a
    restarted job) would resume them, not it. To roll back deliberately,
    ``delete(s)`` each newer step, then save.

    ``metrics``: numbers (python, numpy or jax scalars; ints stay ints),
    nested dicts flattened to ``a/b`` names. ``custom_metadata``: a dict
    JSON holds exactly (str keys, finite numbers), at most 1 MiB as JSON,
    kept in the step's index and returned by ``metadata(step)
    .custom_metadata`` (process 0's value is the one written). ``force`` saves whatever
    ``save_interval_steps`` says (the last step of a run, say).

    In a multi-process job every process calls it with the same step. The
    processes agree before anything is written (ckpt/multihost/agreement.py): all
    save, or all skip a committed step, or all raise the same error naming
    the process that could not prepare its part and why.

    Args:
      step: the step number (an int >= 0), the same on every process.
      state: the PyTree to save.
      metrics: see above; kept with the step, ranked by ``best_metric``.
      transforms: ``fn(state_dict) -> state_dict`` applied, in order, to the
        state (nested dicts keyed by path parts) before it is planned.
      host_state: one msgpack-able value per process, stored in this
        process's own file; read back by ``host_state(step)``.
      force: save even if ``should_save(step)`` is False.
      custom_metadata: see above.

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
    step = queries.check_step(step)
    if not force and not self.should_save(step):
      # should_save decided from agreed facts only (no I/O and no round,
      # but for its one first-step round). A skip does not wait for the
      # save in flight either, so its failure comes from the next save that
      # writes (the same one on every process).
      return False
    # The key first: whatever fails below on one process goes into the
    # round, so every process raises and no later key drifts.
    key = multihost.call_key(self._key_base, "save", step)
    coord0 = multihost.coordination_stats()
    t0 = time.perf_counter()
    plan, host_bytes, values, error, plan_s = None, b"", [], None, 0.0
    planned = 0
    custom = None
    try:
      self._check_open()
      self._wait_for_save()  # the previous save's failure, if any
      metrics = save_extras.check_metrics(metrics)
      custom = save_extras.check_custom_metadata(custom_metadata)
      if transforms:  # they see and return nested dicts keyed by path parts
        state = tree.nest(dict(tree.flatten(state)))
        for fn in transforms:
          state = fn(state)
      host_bytes = save_extras.pack_host_state(host_state)
      t_plan = time.perf_counter()
      plan, planned = self._plan_cache.plan(state, self._options,
                                            self.partitioner)
      plan_s = time.perf_counter() - t_plan
      plan.borrow = not self.async_save
      values = agreement.host_values(plan.leaves)
    except Exception as e:  # pylint: disable=broad-except
      error = e  # every process hears of it in the round below
    started: list = []  # process 0: the save's deadline, set at prepare
    decision = agreement.save_round(
        key, step, error, values, lambda: self._prepare_attempt(step, started),
        timeout_s=self.barrier_timeout_s)
    self._has_checkpoint = True  # agreed: committed already, or about to be
    self._last_saved = step
    if decision.action == "skip":
      logging.warning("ckpt: step %d is already committed in %s; not saving "
                      "it again", step, self.storage.url)
      self.last_save_stats = save_lib.SaveStats(step=step, skipped=True)
      return False
    attempt = finalize.Attempt(
        step=step, key=key, token=decision.token,
        work_dir=steps_lib.work_dir(self.storage, step, decision.token),
        timeout_s=self.barrier_timeout_s, lease_s=self.lease_s)
    stats = save_lib.SaveStats(step=step, plan_s=plan_s,
                               planned_leaves=planned)
    self.last_save_stats = stats
    staged = threading.Event()
    fut = asyncio.run_coroutine_threadsafe(deadline_lib.bounded(
        self._save_async(attempt, plan, metrics, host_bytes, stats, staged, t0,
                         coord0, custom),
        started[0] if started else self._save_deadline(step)), self._loop)
    with self._lock:
      self._inflight, self._inflight_step = fut, step
      self._attempt = attempt
    if self.async_save:
      staged.wait()
      stats.blocking_s = time.perf_counter() - t0
      if fut.done():
        self._wait_for_save()
    else:
      self._wait_for_save()
      stats.blocking_s = stats.total_s
    return True

  def _prepare_attempt(self, step: int, started: list) -> str | None:
    """Process 0, in the save round: None if ``step`` is committed, else the
    token of a fresh, empty attempt directory. The save's deadline starts
    here (appended to ``started``): its first request.

    A step lower than the newest committed one is refused here
    (``agreement.SaveRefused``, raised on every process), before anything
    is written: see ``save``."""
    deadline = self._save_deadline(step)
    started.append(deadline)
    with deadline_lib.scope(deadline):
      newest = self._newest_bound()
      if newest > step:  # confirmed by a fresh listing (then refused)
        steps = self._committed_now()
        newer = [s for s in steps if s > step]
        if newer:  # committed or not, it would not be the step resumed
          raise agreement.SaveRefused(refusal(step, newer,
                                              f"in {self.storage.url!r}"))
        newest = steps[-1] if steps else -1
      if steps_lib.is_committed(self.storage, step):
        return None
      token = multihost.unique_token()
      commit_lib.prepare(self.storage, step, token, self.lease_s)
      self._newest, self._after_commit = _UNKNOWN, max(newest, step)
      return token

  def _newest_bound(self) -> int:
    """Process 0: a step that no committed step is above, the save in
    flight counted (-1: none). No I/O once known: from the last listing
    and the saves committed since; listed when unknown (a fresh
    Checkpointer, a failed save, ``delete``, ``reload``). On an object
    store whose commit records are not complete yet, the migration that
    the save's prepare makes anyway comes first, so the one listing of the
    whole root is not made twice."""
    with self._lock:
      flying = self._inflight is not None and not self._inflight.done()
      flying_step = self._inflight_step if flying else -1
    known = self._after_commit if flying else self._newest
    if known is not _UNKNOWN:
      return known
    if not self.storage.is_posix and not records.records_complete(
        self.storage):
      try:
        steps_lib._ensure_records(self.storage)  # pylint: disable=protected-access
      except CheckpointError as e:
        logging.warning("ckpt: could not make the commit records of %s "
                        "complete: %s", self.storage.url, e)
    steps = self._committed_now()
    return max(steps[-1] if steps else -1, flying_step)

  def _committed_now(self) -> list[int]:
    """Process 0: the committed steps, listed now; their newest is noted
    when no save is in flight (one in flight commits on the background
    thread, and notes its step then)."""
    with self._lock:
      idle = self._inflight is None or self._inflight.done()
    steps = steps_lib.committed_steps(self.storage)
    if idle:
      with self._lock:
        idle = self._inflight is None or self._inflight.done()
        if idle:
          self._newest = steps[-1] if steps else -1
    return steps

  def _save_deadline(self, step: int, doing: str = "writing step {} to"
                     ) -> deadline_lib.Deadline | None:
    """The deadline of saving (or deleting) ``step``, from now."""
    return deadline_lib.Deadline.start(
        self.save_timeout_s, "save_timeout_s",
        f"{doing.format(step)} {self.storage.url!r}")

  def _query_deadline(self) -> deadline_lib.Deadline | None:
    """The deadline of a query, from now; the store call in flight names
    the operation ("listing the steps of 's3://...'")."""
    return deadline_lib.Deadline.start(self.query_timeout_s, "query_timeout_s")

  async def _save_async(self, attempt: finalize.Attempt, plan, metrics,
                        host_bytes: bytes, stats: save_lib.SaveStats,
                        staged: threading.Event, t0: float,
                        coord0: multihost.CoordinationStats,
                        custom: str | None = None) -> None:
    cleanup = None
    self._task = asyncio.current_task()  # what cancel() cancels
    if self.async_save:  # the training job's cores first (ckpt/save/polite.py)
      polite.lower_tensorstore_threads()
    try:
      if multihost.process_index() == 0:
        # Abandoned work of crashed jobs and failed saves goes at every save
        # (one listing of the root, or of pending/ on a bucket; never when a
        # Checkpointer opens: a reader must not delete anything).
        cleanup = asyncio.ensure_future(  # alongside, not ahead of staging
            asyncio.to_thread(self._remove_abandoned, attempt.work_dir))
      try:
        await finalize.run_save(attempt, plan, self.storage, self._context,
                                self.concurrent_bytes, metrics, host_bytes,
                                stats, staged.set, clock=self._clock,
                                custom_metadata=custom)
      except BaseException:
        # A failed save (its tiling found wrong, say) is planned afresh
        # next time, never from the plan it failed with.
        self._plan_cache.clear()
        raise
      if multihost.process_index() == 0:
        self._newest = self._after_commit  # committed: the newest known
        self._metrics_cache[attempt.step] = dict(metrics)
        self._time_cache.pop(attempt.step, None)  # read from the new index
        self._retention.start(attempt.step)
    finally:
      if cleanup is not None:
        await asyncio.gather(cleanup, return_exceptions=True)
      staged.set()
      stats.total_s = time.perf_counter() - t0
      # Every call of this process in the meantime (the caller's other
      # collective calls during an async save would count too).
      coord = multihost.coordination_stats() - coord0
      stats.coordination_s = coord.seconds
      stats.barriers, stats.kv_calls = coord.barriers, coord.kv_calls

  def _remove_abandoned(self, own: str) -> None:
    reasons: dict[str, str] = {}
    try:
      names = cleanup_lib.abandoned(self.storage, self.lease_s, reasons)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("ckpt: could not look for abandoned saves in %s: %s",
                      self.storage.url, e)
      return
    for name in names:
      if name == own:
        continue
      logging.info("ckpt: removing abandoned %s in %s: %s", name,
                   self.storage.url, reasons.get(name, "an unfinished deletion"))
      try:
        cleanup_lib.remove_abandoned(self.storage, name)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("ckpt: could not remove abandoned %s: %s", name, e)

  def _wait_for_save(self, timeout: float | None = None) -> None:
    """Blocks until the in-flight save is committed; re-raises its failure.

    Every thread that waits, waits for the commit (the save stays tracked
    until it is done, whoever waits and however a wait ends, Ctrl-C or a
    ``timeout`` included); each of them sees its failure.
    """
    with self._lock:
      fut, step = self._inflight, self._inflight_step
    if fut is None:
      return
    try:
      try:
        fut.result(timeout)
      except concurrent.futures.TimeoutError:
        if fut.done():
          raise  # the save itself raised a TimeoutError: its failure
        raise WaitTimeoutError(
            f"wait_until_finished(timeout={timeout}): the save of step "
            f"{step} was not committed after {timeout} s on process "
            f"{multihost.process_index()}; it goes on in the background and "
            "stays tracked (wait again, or the next save or close waits for "
            "it)") from None
    except WaitTimeoutError:
      raise
    except CheckpointError as e:
      if f"step {step}" in str(e):
        raise  # it names the step already (barrier timeouts do)
      raise CheckpointError(
          f"saving step {step} failed on process "
          f"{multihost.process_index()}: {e}") from e
    except Exception as e:
      raise CheckpointError(
          f"saving step {step} failed on process "
          f"{multihost.process_index()}: {type(e).__name__}: {e}") from e
    finally:
      if fut.done():
        with self._lock:
          if self._inflight is fut:
            self._inflight = None

  def _settle(self) -> None:
    """Lets the in-flight save end (a restore of the latest step wants its
    commit); its failure stays for the next save or wait."""
    with self._lock:
      fut = self._inflight
    if fut is not None:
      concurrent.futures.wait([fut])

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
    self._wait_for_save(timeout)
    self._wait_for_retention(
        None if deadline is None else max(0.0, deadline - time.monotonic()),
        timeout)

  def _wait_for_retention(self, left: float | None = None,
                          timeout: float | None = None) -> None:
    if self._closed:
      return
    fut = asyncio.run_coroutine_threadsafe(self._retention.wait(), self._loop)
    try:
      fut.result(left)
    except concurrent.futures.TimeoutError:
      if fut.done():
        raise
      raise WaitTimeoutError(
          f"wait_until_finished(timeout={timeout}): the save is committed, "
          f"but retention (deleting the steps the policy drops) was still "
          f"running after {timeout} s; it goes on in the background") from None

  def check_for_errors(self) -> None:
    """Raises the failure of the last background save now, if it has
    failed; returns at once otherwise (a save still in flight, or none).
    Never waits. The failure is raised once, by whichever of this,
    ``wait_until_finished``, the next ``save`` or ``close`` comes first.
    Not collective: each process checks its own save (all processes'
    saves fail together: the failure travels with the save's barriers)."""
    with self._lock:
      fut = self._inflight
    if fut is not None and fut.done():
      self._wait_for_save()

  def cancel(self) -> bool:
    """Abandons the save in flight on every process and removes its
    attempt; returns True once that is done everywhere, False if no save
    was in flight (or it had committed: then it stays committed).

    For a job that must exit now. Collective: every process calls it.
    Each process stops its part of the save (requests already sent to the
    store end first, ckpt/store/tsfuture.py); then one round, in which process 0
    removes the attempt (its uncommitted work directory and pending record)
    unless the step committed meanwhile; every process returns the same
    answer. The save's failure is not raised (it was cancelled); the
    Checkpointer takes the next save as usual. Retention of an earlier
    save goes on (``wait_until_finished`` waits for it).
    """
    key = multihost.call_key(self._key_base, "cancel")
    with self._lock:
      fut, step, attempt = self._inflight, self._inflight_step, self._attempt
    mine = {"step": None, "waiting": None}
    if not self._closed and fut is not None and not fut.done():
      mine["step"] = step
      try:
        asyncio.run_coroutine_threadsafe(self._cancel_task(),
                                         self._loop).result()
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("ckpt: cancel(): stopping the save of step %s: %s",
                        step, e)
      if attempt is not None and attempt.waiting:
        mine["waiting"] = attempt.waiting[0]

    def decide(posts: dict[int, str]) -> str:
      got = {p: json.loads(v) for p, v in posts.items()}
      steps = sorted({g["step"] for g in got.values()
                      if g["step"] is not None})
      # At most one barrier has waiting threads (a process past a barrier
      # means every process arrived there): the others arrive there too.
      waiting = sorted({g["waiting"] for g in got.values() if g["waiting"]})
      out = {"cancelled": False, "why": "", "release": waiting[:1],
             "waiting": [p for p, g in got.items() if g["waiting"]]}
      if not steps:
        return json.dumps(out)
      try:
        if (attempt is None or attempt.step != steps[-1] or
            steps_lib.is_committed(self.storage, attempt.step)):
          out["why"] = f"step {steps[-1]} committed meanwhile"
          return json.dumps(out)
        out["cancelled"] = True
        cleanup_lib.remove_attempt(self.storage, attempt.step, attempt.token)
      except Exception as e:  # pylint: disable=broad-except
        out["why"] = (
            f"the attempt {attempt.token} of step {attempt.step} in "
            f"{self.storage.url!r} could not be removed ({e}); the next "
            "save's cleanup removes it once its lease is "
            f"{self.lease_s:g} s old")[:1000]
      return json.dumps(out)

    decision = json.loads(multihost.agree(
        key, json.dumps(mine), decide, timeout_s=self.barrier_timeout_s,
        what="cancel(): every process stopped its save"))
    pid = multihost.process_index()
    for name in decision["release"]:
      if pid not in decision["waiting"]:
        # Releases the threads of the processes that were cancelled while
        # waiting there (their result is dropped).
        try:
          multihost.barrier(name, timeout_s=self.barrier_timeout_s,
                            what="cancel(): releasing the cancelled save's "
                            "barrier")
        except CheckpointError as e:
          logging.warning("ckpt: cancel(): %s", e)
    with self._lock:
      if mine["step"] is not None and self._inflight is fut:
        self._inflight = None  # its failure is the cancel, not raised
      self._newest = self._after_commit = _UNKNOWN
    if decision["why"]:
      logging.warning("ckpt: cancel(): %s", decision["why"])
    if decision["cancelled"]:
      self._last_saved = _UNKNOWN  # the step was not saved
      logging.info("ckpt: cancelled the save of step %s in %s", step,
                   self.storage.url)
    return bool(decision["cancelled"])

  async def _cancel_task(self) -> None:
    """On the loop: cancels the save's task and waits until it ended
    (its TensorStore requests end first, ckpt/store/tsfuture.py)."""
    task = self._task
    if task is None or task.done():
      return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

  def is_saving_in_progress(self) -> bool:
    """True while the last save is not yet committed (or failed) on this
    process; its retention does not count. Not collective (no I/O): each
    process answers for itself.

    Never raises.
    """
    with self._lock:
      fut = self._inflight
    return fut is not None and not fut.done()

  # ---- restore ----------------------------------------------------------

  def restore(self, step: int | None = None, *, target: Any = None,
              path: str | None = None, transforms: Sequence[Callable] = (),
              fallback_state: Any = None, lazy: bool = False,
              verify: bool = False, read_once: Any = "default") -> Any:
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
      verify: check the crc32c recorded at save of every stored box that
        overlaps what this process reads (that data is read twice); a
        mismatch raises CorruptCheckpointError naming the leaf.
      read_once: True / False / None (automatic) for this call; by default
        the Checkpointer's ``read_once``. With it, the processes that hold
        the same box of a leaf (replicas over mesh axes its PartitionSpec
        does not use) each read a distinct part of it, in whole stored
        chunks (each chunk fetched once over all processes), and exchange
        the parts with a collective run on this (the caller's) thread, in
        batches within ``concurrent_bytes``. Every process must pass the
        same value (checked). Leaves it cannot apply to are read as usual:
        typed PRNG keys, values in memory (inline leaves, fallbacks), leaves
        derived by a transform whose dimensions do not divide by the
        replica count. ``last_restore_stats`` says what it did (bytes read,
        bytes fetched from the store, leaves exchanged). With ``lazy=True`` the leaves it applies to read
        once when read later with the sharding they were bound to:
        ``leaf.read()`` of such a leaf is then a collective call, which
        every process must make, for the same leaves in the same order
        (like a jitted function over global arrays); the leaves' reads add
        to this restore's ``last_restore_stats`` object.

    In a multi-process job every process calls it; process 0 picks the step
    (the latest, or checks that all asked for the same one) and every
    process restores that step.
    """
    # Both keys first: nothing below may shift them on one process only.
    read_key = self._read_key()
    key = multihost.call_key(self._key_base, "readonce")  # every restore
    t_start = time.perf_counter()
    meter = storemeter.Meter()  # bytes fetched from the store, this process
    with meter:
      return self._restore(step, target, path, transforms, fallback_state,
                           lazy, verify, read_once, read_key, key, t_start,
                           meter)

  def _restore(self, step, target, path, transforms, fallback_state, lazy,
               verify, read_once, read_key, key, t_start, meter):
    if isinstance(read_once, str) and read_once == "default":
      read_once = self.read_once
    storage, error = self.storage, None
    try:  # this process's own checks; a failure joins the round below
      self._check_open()
      readonce.min_replicas(read_once, "")  # validates it
      if path is not None:
        storage = storage_lib.Storage(path, self._storage_options)
    except Exception as e:  # pylint: disable=broad-except
      error = e
    self._settle()
    if path is not None:
      # Processes may each read their own copy (a path on a local disk):
      # then each finds its own step directory.
      step_dir = self._agreed(
          f"restore(path=..., step={step!r}, read_once={read_once!r}, "
          f"store={readonce.storage_kind(storage.url)})",
          lambda: restore_lib.locate_path(storage, step),
          f"the step directory under {os.fspath(path)!r}",
          where=storage.url, key=read_key, error=error)
      is_resuming, protected = False, None
    else:
      step, step_dir, is_resuming = self._agreed(
          f"restore(step={step!r}, read_once={read_once!r})",
          lambda: self._choose_step(step),
          f"the step to restore from {self.storage.url!r}", key=read_key,
          error=error)
      protected = step if multihost.process_index() == 0 else None
    read_once_min = readonce.min_replicas(read_once, storage.url)
    stats = readonce.RestoreStats(read_once=read_once)
    counter = readonce.ReadCounter()
    self.last_restore_stats = stats
    # With read-once on (agreed: the same on every process), a process that
    # fails must say so before the others start an exchange it never joins.
    rounds = read_once_min is not None and multihost.is_multiprocess()
    lazy_reads = None
    if lazy:  # the leaves' later reads count here; read once: collectives
      if rounds and self._lazy_rounds is None:
        self._lazy_rounds = readonce.LazyRounds(f"{key}-lazy",
                                                self.barrier_timeout_s)
      lazy_reads = readonce.LazyReads(
          counter, stats, self._lazy_rounds if rounds else None,
          name=f"restore {key}", meter=meter)

    def check(i, e):
      """The round before exchange i: every process's outcome, and what
      it fetched so far (the last round's sum is fetched_bytes_all)."""
      if rounds:
        sums = multihost.all_ok(
            f"{key}/{i}", e, f"restore from {step_dir!r}",
            self.barrier_timeout_s, tally=meter.value)
        if sums:
          stats.fetched_bytes_all = sum(sums.values())
    try:
      result, error = None, None
      try:  # everything that can fail on this process alone, before "read"
        guard = keepalive = None
        if lazy and path is None:
          guard = steps_lib.guard(storage, step)
          if protected is not None:  # the step outlives this call
            keepalive = self._retention.keepalive(step)
        args = restore_lib.RestoreArgs(
            target=target, restore_dtype=self.restore_dtype,
            transforms=tuple(transforms), fallback_state=fallback_state,
            lazy=lazy, is_resuming=is_resuming, verify=verify, guard=guard,
            keepalive=keepalive, read_once_min=read_once_min,
            lazy_reads=lazy_reads)
        result = self._run(readonce.counted(restore_lib.restore(
            storage, step_dir, args, self.concurrent_bytes, self._context),
            counter))
      except Exception as e:  # pylint: disable=broad-except
        if not rounds:
          raise
        error = e
      check("read", error)
      if rounds:
        # Every process reached this restore's first round, so each is done
        # with the previous restore's rounds: their keys can go.
        if self._readonce_key is not None:
          multihost.forget(self._readonce_key)
        self._readonce_key = key
      # The exchange: collectives on this (the caller's) thread; the reads
      # of each batch on the background thread.
      result = readonce.finish(
          result, lambda batch: self._run(readonce.counted(
              restore_lib.read_parts(batch, self.concurrent_bytes), counter)),
          self.concurrent_bytes, stats, check)
      return result
    finally:
      stats.add_reads(counter)
      stats.fetched_bytes = meter.value
      if not multihost.is_multiprocess():
        stats.fetched_bytes_all = stats.fetched_bytes
      stats.total_s = time.perf_counter() - t_start
      if protected is not None:
        self._retention.release(protected)

  def _choose_step(self, step: int | None) -> list:
    """Process 0: [step, its directory, whether it is the latest], with the
    step protected from retention until the restore ends."""
    steps = self._committed_now()
    step = restore_lib.resolve_step(self.storage, step, steps)
    self._retention.protect(step)
    try:
      step_dir = steps_lib.step_dir(self.storage, step)  # gone if deleted meanwhile
    except BaseException:
      self._retention.release(step)
      raise
    return [step, step_dir, step == steps[-1]]

  def _agreed(self, request: str, answer: Callable[[], Any], what: str,
              where: str = "", *, key: str | None = None,
              error: BaseException | None = None) -> Any:
    """``answer()`` computed once by process 0, within the query bound
    (``query_timeout_s``); every process gets it.

    The call's key is taken before anything of the call can fail (``key``:
    taken by the caller already). ``error``: this process's own checks
    failed (a closed Checkpointer, a bad argument or path); the failure
    joins the round, so every process raises and later calls keep their
    keys (agreement.read_round)."""
    if key is None:
      key = self._read_key()

    def bounded() -> Any:
      return deadline_lib.call(self._query_deadline(), answer)
    return agreement.read_round(
        key, request, bounded, timeout_s=self.barrier_timeout_s, what=what,
        where=where, local_error=error)

  def _read_key(self) -> str:
    """The key of the next read round (restore, the queries); taken before
    anything of the call can fail (multihost.call_key)."""
    return multihost.call_key(self._key_base, "read")

  def _run(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

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
      self._preemption_step = step  # should_save(step) is True for it
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
    if self._closed:
      return
    try:
      self.wait_until_finished()
    finally:
      self._closed = True
      try:  # nothing may call back into the loop once it is closed
        asyncio.run_coroutine_threadsafe(_drain(), self._loop).result(60)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("ckpt: background work still running at close: %s", e)
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(timeout=60)
      if not self._thread.is_alive():
        self._loop.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _open_error(self) -> Exception | None:
    """``_check_open``'s error, returned, for a collective call to post in
    its round instead of raising on this process alone."""
    try:
      self._check_open()
    except Exception as e:  # pylint: disable=broad-except
      return e
    return None

  def _check_open(self) -> None:
    if self._closed:
      raise CheckpointError("this Checkpointer is closed")


async def _drain() -> None:
  """Cancels what is left on the loop (a lazy read given up, say) and waits
  for it and for the loop's worker threads, so that no TensorStore or
  thread callback reaches the loop after it is closed."""
  tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
  for t in tasks:
    t.cancel()
  await asyncio.gather(*tasks, return_exceptions=True)
  await asyncio.get_running_loop().shutdown_default_executor()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
  """The background thread: at a lower priority, as is every thread it
  starts (ckpt/save/polite.py)."""
  polite.lower_this_thread()
  loop.run_forever()


def _close_at_exit(ref: "weakref.ref[Checkpointer]") -> None:
  ckptr = ref()
  if ckptr is None or ckptr._closed:  # pylint: disable=protected-access
    return
  try:
    ckptr.close()
  except Exception as e:  # pylint: disable=broad-except
    logging.error("ckpt: the last save did not finish at exit: %s", e)


def refusal(step: int, newer: list[int], where: str) -> str:
  """The message of a refused save of ``step``, lower than the committed
  ``newer`` steps (``where``: in which directory or tier); the same for a
  Checkpointer and both tiers of a MultiTierCheckpointer."""
  shown = newer if len(newer) <= 20 else [*newer[:10], "...", *newer[-10:]]
  return (
      f"cannot save step {step}: newer committed step(s) {shown} exist "
      f"({where}). A save of an older step would start a new timeline while "
      "the newer steps stay, and latest_step()/restore() (a restarted job) "
      "would resume them. To roll back deliberately, call delete(s) for each "
      f"of {shown} (collective), then save step {step} again. Nothing was "
      "written.")
