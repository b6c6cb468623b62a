"""The restore of a Checkpointer, and the agreement rounds of its reads.

``RestoreCalls`` holds the body of ``Checkpointer.restore`` (the agreed
choice of the step, the read on the background loop, then the read-once
exchange on the caller's thread, ckpt/restore/readonce.py), and the read
round that restore and the queries share (``_agreed``: process 0 answers
within ``query_timeout_s``, every process gets the answer). Its reads stall
at most ``query_timeout_s`` (ckpt/store/deadline.py). A mixin of
``ckpt.Checkpointer``: it uses the Checkpointer's fields, made in its
``__init__``.
"""

from __future__ import annotations

import itertools
import json
import os
import time

from absl import logging
from typing import Any, Callable

from ckpt.multihost import agreement
from ckpt.commit import steps as steps_lib
from ckpt.store import deadline as deadline_lib
from ckpt.multihost import process as multihost
from ckpt.restore import readonce
from ckpt.restore import read as restore_lib
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.calls_save import size_text


class RestoreCalls:
  """The restore of ``ckpt.Checkpointer`` (a mixin; see the module
  docstring)."""

  def _restore(self, step, target, path, transforms, fallback_state, lazy,
               verify, read_once, read_key, key, t_start, meter):
    if isinstance(read_once, str) and read_once == "default":
      read_once = self.read_once
    step_arg = step
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
    # A resume falls back past steps that fail verification (on every
    # process alike: _fallback_round); an explicit step or path raises.
    may_fall_back = verify and not lazy and path is None and step_arg is None
    damaged: list[int] = []
    for attempt in itertools.count():
      run_key = key if attempt == 0 else f"{key}/fallback{attempt}"
      try:
        result, error = self._restore_step(
            storage, step, step_dir, path, is_resuming, protected, target,
            transforms, fallback_state, lazy, verify, read_once,
            read_once_min, run_key, t_start, meter), None
      except Exception as e:  # pylint: disable=broad-except
        if not may_fall_back:
          raise
        result, error = None, e
      finally:
        if protected is not None:
          self._retention.release(protected)
          protected = None
      if may_fall_back:
        older = self._fallback_round(f"{run_key}/verified", error, step)
        if older is not None:
          damaged.append(step)
          self._retention.set_damaged(damaged)
          step, step_dir = older
          if multihost.process_index() == 0:
            protected = step  # _fallback_round protected it
          continue
      if error is not None:
        raise error
      self.last_restore_step = step
      stats = self.last_restore_stats
      logging.info(
          "ckpt: restored step %s from %s: this process read %s in %.2f s "
          "(%.2f GB/s)%s", step, storage.url, size_text(stats.bytes_read),
          stats.total_s, stats.bytes_read / stats.total_s / 1e9
          if stats.total_s > 0 else 0.0,
          f" after falling back past damaged step(s) {damaged}"
          if damaged else "")
      return result

  def _restore_step(self, storage, step, step_dir, path, is_resuming,
                    protected, target, transforms, fallback_state, lazy,
                    verify, read_once, read_once_min, key, t_start, meter):
    """Reads one step (``step_dir``) as the caller asked."""
    reading = f"step {step}" if path is None else f"{step_dir!r}"
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
          name=f"restore {key}", meter=meter,
          deadline=lambda: self._read_deadline(storage, reading))

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
        result = self._run(deadline_lib.bounded(readonce.counted(
            restore_lib.restore(storage, step_dir, args,
                                self.concurrent_bytes, self._context),
            counter), self._read_deadline(storage, reading)))
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
          result, lambda batch: self._run(deadline_lib.bounded(
              readonce.counted(restore_lib.read_parts(
                  batch, self.concurrent_bytes), counter),
              self._read_deadline(storage, reading))),
          self.concurrent_bytes, stats, check)
      return result
    finally:
      stats.add_reads(counter)
      stats.fetched_bytes = meter.value
      if not multihost.is_multiprocess():
        stats.fetched_bytes_all = stats.fetched_bytes
      stats.total_s = time.perf_counter() - t_start

  def _fallback_round(self, key: str, error: BaseException | None,
                      step: int) -> tuple[int, str] | None:
    """After a resume read ``step``: every process says whether it found
    damaged data. If any did, all get (the newest older step, its
    directory), chosen by process 0 and protected there from retention,
    and log one WARNING naming what failed; None if none did (or no older
    step is left: then the corrupt process raises its error and every
    other one a CorruptCheckpointError naming it)."""
    corrupt = isinstance(error, CorruptCheckpointError) or (
        isinstance(error, CheckpointError) and
        "CorruptCheckpointError" in str(error))  # another's, via all_ok
    post = json.dumps(["corrupt" if corrupt else "error" if error else "ok",
                       "" if error is None else str(error)[:2000]])

    def decide(posts: dict[int, str]) -> str:
      got = {p: json.loads(v) for p, v in sorted(posts.items())}
      bad = [(p, g[1]) for p, g in got.items() if g[0] == "corrupt"]
      if not bad:
        failed = {p: g[1] for p, g in got.items() if g[0] == "error"}
        return json.dumps({"failed": failed} if failed else {})
      p, why = bad[0]
      try:
        older = [s for s in self._committed_now() if s < step]
        choice = None
        if older:
          choice = older[-1]
          self._retention.protect(choice)
          choice = [choice, steps_lib.step_dir(self.storage, choice)]
      except Exception as e:  # pylint: disable=broad-except
        choice, why = None, f"{why}; and no older step could be chosen: {e}"
      return json.dumps({"process": p, "why": why, "older": choice})

    out = json.loads(multihost.agree(
        key, post, decide, timeout_s=self.barrier_timeout_s,
        what=f"whether step {step} verified on every process"))
    if not out:
      return None
    if "failed" in out:  # every process ends alike
      if error is not None:
        raise error
      raise CheckpointError(
          f"restore of step {step} failed on process(es) "
          f"{sorted(int(p) for p in out['failed'])}: " + "; ".join(
              f"process {p}: {m}" for p, m in out["failed"].items()))
    if out["older"] is None:
      if error is not None:
        raise error
      raise CorruptCheckpointError(
          f"step {step} failed verification on process {out['process']} "
          f"and no older committed step is left: {out['why']}")
    older, older_dir = out["older"]
    logging.warning(
        "ckpt: step %d in %s failed verification (process %d: %s); resuming "
        "from step %d, the newest older step, instead", step,
        self.storage.url, out["process"], out["why"], older)
    return older, older_dir

  def _read_deadline(self, storage: storage_lib.Storage, what: str
                     ) -> deadline_lib.Deadline | None:
    """The bound of a restore's reads of ``what`` ("step 5"):
    ``query_timeout_s`` without progress (ckpt/store/deadline.py), however
    long the reads take."""
    return deadline_lib.Deadline.start(
        self.query_timeout_s, "query_timeout_s",
        f"reading {what} from {storage.url!r}")

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
