"""The public Checkpointer.

Concurrency model (the only one in ckpt): the API is synchronous; inside,
one asyncio event loop runs on one background thread owned by the
Checkpointer. Every TensorStore call, barrier and retention step of a save
runs there. At most one save is in flight: ``save`` first waits for the
previous one. ``save`` returns when its data is staged on the host (async
mode) or when it is committed (``async_save=False``). A failure on the
background thread is stored and re-raised by the next ``save``,
``wait_until_finished`` or ``close``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import operator
import os
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from absl import logging
import msgpack

from ckpt import index as index_lib
from ckpt import multihost
from ckpt import ocdbt
from ckpt import restore as restore_lib
from ckpt import save as save_lib
from ckpt import storage as storage_lib
from ckpt import tree
from ckpt import tsspec
from ckpt.errors import CheckpointError, InvalidStateError
from ckpt.limiter import ByteLimiter
from ckpt.plan import DEFAULT_CHUNK_BYTES
from ckpt.retention import RetentionPolicy

DEFAULT_CONCURRENT_BYTES = 1 << 30


class Checkpointer:
  """Saves and restores sharded JAX PyTrees under one directory.

  Args:
    directory: a path, ``file://``, ``gs://``, ``s3://`` or ``memory://`` URL.
    keep, keep_period, best_metric, best_mode, keep_checkpoints_without_metrics:
      the retention policy applied after each commit (see RetentionPolicy).
    save_dtype / restore_dtype: cast floating leaves before writing / after
      reading (e.g. ``"bfloat16"``).
    format: ``"zarr"`` (v2), ``"zarr3"`` or ``"ocdbt"`` (zarr3 inside OCDBT:
      few files per step; each process writes its own database and process 0
      merges them at finalize, see ckpt/ocdbt.py).
    concurrent_bytes: one host-memory budget for data in flight (staged and
      being written, or being read) in a save or restore.
    async_save: ``save`` returns once device data is staged on the host.
    partitioner: for host numpy leaves, ``fn(path, shape) -> Sharding|None``
      (see ``ckpt.MeshPartitioner``); None means replicated.
    storage_options: merged into the TensorStore kvstore spec (endpoint,
      region, request concurrency and retries...; see ckpt/storage.py for the
      environment variables read without it).
    compression: None (raw chunks) or ``"zstd"``.
    chunk_bytes: target size of one stored chunk.
    barrier_timeout_s: how long a process waits for the others at a barrier.
  """

  def __init__(self, directory: str | os.PathLike, *,
               keep: int | None = None, keep_period: int | None = None,
               best_metric: str | None = None, best_mode: str = "min",
               keep_checkpoints_without_metrics: bool = True,
               save_dtype: Any = None, restore_dtype: Any = None,
               format: str = "zarr",  # noqa: A002 (the design's name)
               concurrent_bytes: int = DEFAULT_CONCURRENT_BYTES,
               async_save: bool = True, partitioner: Callable | None = None,
               storage_options: dict | None = None,
               compression: str | None = None,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               barrier_timeout_s: float = multihost.DEFAULT_TIMEOUT_S):
    self.policy = RetentionPolicy(keep, keep_period, best_metric, best_mode,
                                  keep_checkpoints_without_metrics)
    if int(concurrent_bytes) <= 0:
      raise ValueError(f"concurrent_bytes must be positive, got {concurrent_bytes}")
    self._options = save_lib.SaveOptions(
        storage_format=tsspec.check_format(format),
        codec=tsspec.Codec(compression), chunk_bytes=int(chunk_bytes),
        save_dtype=save_dtype, max_item_bytes=int(concurrent_bytes))
    self.restore_dtype = restore_dtype
    self.concurrent_bytes = int(concurrent_bytes)
    self.async_save = async_save
    self.partitioner = partitioner
    self.barrier_timeout_s = barrier_timeout_s
    self._storage_options = storage_options
    self.storage = storage_lib.Storage(directory, storage_options)
    self._context = self.storage.context()
    self._id = multihost.next_instance_id()
    self._seq = itertools.count()
    self._metrics_cache: dict[int, dict[str, float]] = {}
    self._inflight: concurrent.futures.Future | None = None
    self._inflight_step: int | None = None
    self._restoring: set[int] = set()
    self.last_save_stats = save_lib.SaveStats()
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever,
                                    name="ckpt-background", daemon=True)
    self._thread.start()
    self._closed = False
    self._cleaned_up = False
    # A job that ends without close() still finishes (commits) its last save.
    # It must run before the interpreter stops thread pools (asyncio.to_thread
    # refuses work after that), which plain atexit handlers do not.
    concurrent.futures.ThreadPoolExecutor  # pylint: disable=pointless-statement
    # (imports the pool module now, so its exit hook is older and runs after)
    getattr(threading, "_register_atexit", atexit.register)(
        _close_at_exit, weakref.ref(self))

  # ---- save -------------------------------------------------------------

  def save(self, step: int, state: Any, *, metrics: dict | None = None,
           transforms: Sequence[Callable] = (), host_state: Any = None) -> bool:
    """Saves ``state`` as ``step``; returns False if the step already exists."""
    self._check_open()
    given = step
    try:
      step = operator.index(step)
    except TypeError:
      step = -1
    if step < 0:
      raise ValueError(f"step must be a non-negative int, got {given!r}")
    self.wait_until_finished()
    if self.storage.is_committed(step):
      logging.warning("ckpt: step %d is already committed in %s; not saving "
                      "it again", step, self.storage.url)
      self.last_save_stats = save_lib.SaveStats(step=step, skipped=True)
      return False
    metrics = _check_metrics(metrics)
    if transforms:  # they see and return nested dicts keyed by path parts
      state = tree.nest(dict(tree.flatten(state)))
      for fn in transforms:
        state = fn(state)
    host_bytes = _pack_host_state(host_state)
    t0 = time.perf_counter()
    plan = save_lib.plan_save(state, self._options, self.partitioner)
    plan.borrow = not self.async_save
    stats = save_lib.SaveStats(step=step)
    self.last_save_stats = stats
    staged = threading.Event()
    fut = asyncio.run_coroutine_threadsafe(
        self._save_async(step, plan, metrics, host_bytes, stats, staged, t0),
        self._loop)
    self._inflight, self._inflight_step = fut, step
    if self.async_save:
      staged.wait()
      stats.blocking_s = time.perf_counter() - t0
      if fut.done():
        self.wait_until_finished()
    else:
      self.wait_until_finished()
      stats.blocking_s = stats.total_s
    return True

  async def _save_async(self, step: int, plan: save_lib.SavePlan,
                        metrics, host_bytes: bytes, stats: save_lib.SaveStats,
                        staged: threading.Event, t0: float) -> None:
    try:
      await self._save_stages(step, plan, metrics, host_bytes, stats, staged)
    finally:
      staged.set()
      stats.total_s = time.perf_counter() - t0

  async def _save_stages(self, step, plan, metrics, host_bytes, stats, staged):
    pid, n = multihost.process_index(), multihost.process_count()
    key = f"ckpt/{self._id}/{next(self._seq)}"
    timeout = self.barrier_timeout_s

    async def barrier(name: str, what: str, error: BaseException | None = None):
      """A barrier that also carries failures: a process that failed still
      arrives (after saying so), so the others stop now, not at a timeout."""
      if error is not None:
        multihost.report_failure(f"{key}/{name}/failed",
                                 f"{type(error).__name__}: {error}")
      await asyncio.to_thread(multihost.barrier, f"{key}/{name}",
                              timeout_s=timeout, what=f"{what}, step {step}")
      if error is not None:
        raise error
      failed = multihost.reported_failures(f"{key}/{name}/failed")
      if failed:
        raise CheckpointError(
            f"saving step {step} failed on process(es) {sorted(failed)} "
            f"before '{what}'; nothing was committed. "
            + "; ".join(f"process {p}: {m}" for p, m in sorted(failed.items())))

    def start() -> str:  # process 0 picks the work directory, others learn it
      if not self._cleaned_up:
        # Abandoned work of a crashed job goes at this writer's first save
        # (not when a Checkpointer opens: a reader must not delete a save
        # that another Checkpointer has in flight).
        for name in self.storage.abandoned():
          logging.info("ckpt: removing abandoned %s", name)
          self.storage.remove(name)
        self._cleaned_up = True
      token = multihost.unique_token()
      self.storage.prepare(step, self.storage.work_dir(step, token))
      return token

    token = await asyncio.to_thread(
        multihost.broadcast_str, f"{key}/token", start, timeout_s=timeout,
        what=f"the work directory of step {step}")
    work_dir = self.storage.work_dir(step, token)
    step_kvstore = self.storage.step_spec(work_dir)
    # 3-4. stage and write this process's boxes under one byte budget.
    limiter = ByteLimiter(self.concurrent_bytes)
    error = None
    sums: list = []
    try:
      sums = await save_lib.write_owned(plan, step_kvstore, self._context,
                                        limiter, stats, staged.set)
    except Exception as e:  # told to every process at the barrier below
      error = e
    # 5. every process has written.
    await barrier("written", "all processes wrote their data", error)
    host_states = await asyncio.to_thread(
        multihost.gather_bytes, f"{key}/host_state", host_bytes, timeout,
        f"the host_state of step {step}")
    all_sums = await asyncio.to_thread(
        multihost.gather_bytes, f"{key}/checksums",
        msgpack.packb(sums), timeout, f"the checksums of step {step}")
    error = None
    if pid == 0:
      try:
        if plan.options.storage_format == "ocdbt":
          # One database from the per-process ones (ckpt/ocdbt.py).
          await ocdbt.merge(step_kvstore, n, self._context)
        # 6-7. index, then commit.
        checksums = [c for b in all_sums for c in msgpack.unpackb(b)]
        index = save_lib.make_index(plan, step, metrics, host_states, n,
                                    checksums)
        self.storage.write_bytes(f"{work_dir}/{storage_lib.INDEX_NAME}",
                                 index_lib.encode(index))
        self.storage.commit(step, work_dir)
        self._metrics_cache[step] = dict(index.metrics)
        # 8. retention.
        self._apply_retention(protected={step})
      except Exception as e:
        error = e
    # 9. the save is complete everywhere.
    await barrier("done", "commit and retention finished", error)

  def _apply_retention(self, protected: set[int]) -> None:
    steps = self.storage.committed_steps()
    metrics = {}
    if self.policy.best_metric is not None:
      metrics = {s: self.metrics(s) for s in steps}
    doomed = self.policy.to_delete(
        steps, metrics, frozenset(protected | self._restoring))
    for s in doomed:
      logging.info("ckpt: retention deletes step %d", s)
      self.storage.remove(storage_lib.step_dirname(s))
      self._metrics_cache.pop(s, None)

  def wait_until_finished(self) -> None:
    """Blocks until the in-flight save is done; re-raises its failure."""
    fut, self._inflight = self._inflight, None
    if fut is None:
      return
    try:
      fut.result()
    except CheckpointError as e:
      if f"step {self._inflight_step}" in str(e):
        raise  # it names the step already (barrier timeouts do)
      raise CheckpointError(
          f"saving step {self._inflight_step} failed on process "
          f"{multihost.process_index()}: {e}") from e
    except Exception as e:
      raise CheckpointError(
          f"saving step {self._inflight_step} failed on process "
          f"{multihost.process_index()}: {type(e).__name__}: {e}") from e

  # ---- restore ----------------------------------------------------------

  def restore(self, step: int | None = None, *, target: Any = None,
              path: str | None = None, transforms: Sequence[Callable] = (),
              fallback_state: Any = None, lazy: bool = False,
              verify: bool = False) -> Any:
    """Restores ``step`` (default: latest) or the checkpoint at ``path``.

    Args:
      target: a PyTree of ``jax.ShapeDtypeStruct`` (with ``.sharding``) or
        arrays saying where each leaf goes; None returns host numpy values.
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
    """
    self._check_open()
    if self._inflight is not None:
      # The in-flight save's retention (process 0) may delete the step asked
      # for: let it finish everywhere first (its failure stays for later).
      concurrent.futures.wait([self._inflight])
    if path is not None:
      storage = storage_lib.Storage(path, self._storage_options)
      step_dir = restore_lib.locate_path(storage, step)
      is_resuming = False
    else:
      storage = self.storage
      latest = storage.committed_steps()
      step, step_dir = restore_lib.locate(storage, step)
      is_resuming = bool(latest) and step == latest[-1]
    args = restore_lib.RestoreArgs(
        target=target, restore_dtype=self.restore_dtype,
        transforms=tuple(transforms), fallback_state=fallback_state,
        lazy=lazy, is_resuming=is_resuming, verify=verify)
    self._restoring.add(step)
    try:
      return self._run(restore_lib.restore(
          storage, step_dir, args, self.concurrent_bytes, self._context))
    finally:
      self._restoring.discard(step)

  def _run(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

  # ---- preemption -------------------------------------------------------

  def reached_preemption(self, step: int) -> bool:
    """Call at every training step; True at the step to save on preemption.

    All processes get True at the same step after any of them is told to
    stop (SIGTERM or the cluster's preemption notice), so::

      if ckptr.reached_preemption(step):
        ckptr.save(step, state)
        ckptr.wait_until_finished()
        sys.exit(0)
    """
    return multihost.reached_preemption_sync_point(step)

  # ---- queries ----------------------------------------------------------

  def all_steps(self) -> list[int]:
    return self.storage.committed_steps()

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def metrics(self, step: int) -> dict[str, float]:
    if step not in self._metrics_cache:
      _, step_dir = restore_lib.locate(self.storage, step)
      self._metrics_cache[step] = restore_lib.read_index(
          self.storage, step_dir).metrics
    return dict(self._metrics_cache[step])

  def host_state(self, step: int | None = None) -> Any:
    step, step_dir = restore_lib.locate(self.storage, step)
    index = restore_lib.read_index(self.storage, step_dir)
    n = multihost.process_count()
    if index.process_count != n or len(index.host_state or ()) != n:
      raise CheckpointError(
          f"step {step} holds host_state for {index.process_count} processes "
          f"but this job has {n}; host_state is per process and cannot be "
          "mapped onto a different process count")
    return _unpack_host_state(index.host_state[multihost.process_index()])

  # ---- lifecycle --------------------------------------------------------

  def close(self) -> None:
    if self._closed:
      return
    try:
      self.wait_until_finished()
    finally:
      self._closed = True
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(timeout=60)
      if not self._thread.is_alive():
        self._loop.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _check_open(self) -> None:
    if self._closed:
      raise CheckpointError("this Checkpointer is closed")


def _close_at_exit(ref: "weakref.ref[Checkpointer]") -> None:
  ckptr = ref()
  if ckptr is None or ckptr._closed:  # pylint: disable=protected-access
    return
  try:
    ckptr.close()
  except Exception as e:  # pylint: disable=broad-except
    logging.error("ckpt: the last save did not finish at exit: %s", e)


def _check_metrics(metrics: dict | None) -> dict[str, float]:
  out = {}
  for k, v in (metrics or {}).items():
    try:
      out[str(k)] = float(v)
    except (TypeError, ValueError):
      raise InvalidStateError(
          f"metric {k!r} must be a number, got {type(v).__name__} {v!r}"
      ) from None
  return out


def _pack_host_state(value: Any) -> bytes:
  try:
    return msgpack.packb(value, use_bin_type=True)
  except Exception as e:
    raise InvalidStateError(
        f"host_state must be msgpack-able (dicts, lists, str, numbers, bytes); "
        f"got {type(value).__name__}: {e}") from e


def _unpack_host_state(data: Any) -> Any:
  if not isinstance(data, bytes):
    raise CheckpointError(f"host_state entry is {type(data).__name__}, not bytes")
  return msgpack.unpackb(data, raw=False, strict_map_key=False)

