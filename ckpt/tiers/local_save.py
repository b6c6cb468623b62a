"""The save path of the local tier (ckpt/tiers/local_tier.py): ``LocalSaver``
prepares everything of a save that can fail on one process alone before the
start round (the leaves, the plan, the step directory, the host values posted
for the partner), dispatches the partner exchange and stages its own shards
on the caller's thread, and writes, fsyncs, agrees and commits on the writer
thread, which runs on the tier's background loop (ckpt/face/loop.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import queue
import shutil
import threading
import time
from typing import Any, NoReturn

import crc32c
import msgpack
import numpy as np

from absl import logging

from ckpt.face import loop as loop_lib
from ckpt.store.progress import rate_text, size_text
from ckpt.multihost import process as multihost
from ckpt.store import storage as storage_lib
from ckpt.tiers.local_exchange import Budget, TierRounds, wait_ready
from ckpt.tiers.local_leaves import prepare_leaves, flatten
from ckpt.tiers.local_manifest import DATA_FILES, FORMAT, VERSION, box_index
from ckpt.tiers.local_steps import LocalSteps, remove_step
from ckpt.errors import BarrierTimeoutError, CheckpointError
from ckpt.commit import attempt

MAX_HOST_BYTES = 16 << 20   # host_state + host values sent to the partner


@dataclasses.dataclass(frozen=True)
class LocalWrite:
  """One local save, handed from the caller's thread to the writer's."""
  step: int
  key: str                # the save's round (TierRounds.call_key)
  work: str               # step_<step>.tmp-<token>, renamed at the commit
  manifest: dict          # completed by the writer
  files: dict[str, Any]   # own.bin and partner.bin, open for writing
  own_host: bytes         # host_state and host values, msgpack
  src: int                # the process whose replica this one keeps
  t0: float               # when save() began (perf_counter)


@dataclasses.dataclass
class _Written:
  """What the writer found while writing (step 1 of ``_write``)."""
  error: BaseException | None = None
  lost: BarrierTimeoutError | None = None  # the exchange was not in time
  crcs: dict = dataclasses.field(default_factory=dict)  # (file, offset): crc
  drained: bool = False  # the caller said it staged all (None)


class LocalSaver:
  """LocalTier's save: the caller's part and the writer thread's."""

  def __init__(self, steps: LocalSteps, rounds: TierRounds, budget: Budget,
               save_dtype: Any):
    self._steps = steps
    self._rounds = rounds
    self.budget = budget
    # As the persistent tier's (Checkpointer save_dtype): floating leaves
    # cast before they are stored.
    self.save_dtype = save_dtype
    # The writer of a save runs on this tier's own background loop (the
    # one concurrency model, ckpt/face/loop.py), one save at a time.
    self._loop = loop_lib.BackgroundLoop("LocalTier", name="ckpt-local")
    self._fut: concurrent.futures.Future | None = None
    self._broken = ""  # why this process saves no more (an abandoned exchange)
    self.last_save_stats: dict = {}

  def wait(self) -> None:
    """The save in flight ends; its failure is raised (once)."""
    fut, self._fut = self._fut, None
    if fut is not None:
      fut.result()

  def running(self) -> bool:
    """True while the last save's writer has not finished."""
    fut = self._fut
    return fut is not None and not fut.done()

  def finish_within(self, timeout: float) -> bool:
    """Whether the save in flight (if any) ends within ``timeout``
    seconds; its failure is left for ``wait``."""
    fut = self._fut
    if fut is None:
      return True
    done, _ = concurrent.futures.wait([fut], timeout)
    return bool(done)

  def close(self) -> None:
    """Waits for the writer, then stops the background loop."""
    def before_stop():
      fut = self._fut
      if fut is not None:
        concurrent.futures.wait([fut])
    self._loop.close(before_stop)

  def save(self, step: int, state: Any, host_state: Any = None,
           newest: bool = False) -> None:
    """Collective: saves ``step`` to every process's local directory
    (``newest``: the job's newest step, see ``_retain``)."""
    # The key first: a failure below on one process (the previous save's
    # too) goes into the round, so no later key drifts.
    key = self._rounds.call_key("save", step)
    t0 = time.perf_counter()
    lay = self._rounds.layout
    token = multihost.unique_token()
    work = os.path.join(self._steps.dir, f"step_{step}.tmp-{token}")
    src = lay.src[lay.pid]
    manifest = {"format": FORMAT, "version": VERSION, "step": step,
                "process_count": lay.n, "process": lay.pid,
                "local_devices": lay.L, "partner_src": src, "own": {},
                "partner": {}, "host_names": [], "owner": self._steps.owner}
    host_vals, arrays, error = {}, [], None
    try:
      self.wait()
      self._steps.drop_set_aside()  # before this step can commit
      arrays, host_vals, info = prepare_leaves(flatten(state)[0],
                                                self.save_dtype, lay.devs)
      manifest["host_names"] = sorted(host_vals)
      own_host = msgpack.packb({"host_state": host_state, "values": host_vals,
                                **info}, use_bin_type=True)
      if len(own_host) > MAX_HOST_BYTES:
        raise CheckpointError(
            f"host_state and host values (non-jax leaves, jax arrays one "
            f"process holds whole) take {len(own_host)} bytes; the local tier "
            f"sends at most {MAX_HOST_BYTES} to the partner through the "
            "coordination service: make large leaves sharded jax arrays")
    except Exception as e:  # pylint: disable=broad-except
      error = e
    files: dict[str, Any] = {}
    plan: dict = {}
    if error is None:
      try:  # the rest of what can fail on this process alone
        plan = self._prepare(step, key, arrays, work, manifest, own_host,
                             files)
      except Exception as e:  # pylint: disable=broad-except
        error = e
    # Every process learns of a failure on any of them BEFORE the partner
    # exchange: a collective that one process never joins would hang.
    try:
      multihost.all_ok(f"{key}/start", error, f"local save of step {step}",
                       self._rounds.timeout_s)
    except BaseException:
      for f in files.values():
        f.close()
      shutil.rmtree(work, ignore_errors=True)  # this save's own (token)
      self._rounds.defer(key)  # deleted at the next round that passes
      raise
    self._rounds.settle_keys(key)
    # After the round, only what cannot fail on one process alone: the
    # exchange is dispatched, never waited for on this thread (the writer
    # waits for it, at most barrier_timeout_s), and staging waits only for
    # this process's writer to give budget back.
    q: queue.Queue = queue.Queue()
    failed = threading.Event()
    if newest:
      self._steps.saving_newest(step)
    self._fut = self._loop.submit(asyncio.to_thread(
        self._write, LocalWrite(step, key, work, manifest, files, own_host,
                                src, t0), q, failed))
    stats = {"step": step, "own_bytes": plan["own_bytes"],
             "partner_bytes": plan["partner_bytes"]}
    try:
      if lay.n > 1:
        self._exchange(plan["batches"], q, failed, step)
      for offset, nb, data in plan["own"]:  # own shards, distinct boxes only
        if self.budget.acquire(nb, failed):
          # CPU: a view that keeps the buffer alive and undonatable (see
          # save._host_box); an accelerator: a fresh host copy.
          q.put(("own.bin", offset, np.asarray(data), nb))
    except BaseException as e:
      failed.set()
      q.put(("error", 0, e, 0))
      raise
    finally:
      q.put(None)
    stats["blocking_s"] = time.perf_counter() - t0
    self.last_save_stats = stats

  def _prepare(self, step, key, arrays, work, manifest, own_host,
               files) -> dict:
    """Before the round, the part of a save that can fail on this process
    alone: the plan, the step directory and its files (opened into
    ``files``), the host values posted for the partner."""
    lay = self._rounds.layout
    if self._broken:
      raise CheckpointError(self._broken)
    plan = self._plan(arrays, manifest)
    try:
      os.makedirs(work)
      for fname in DATA_FILES.values():
        files[fname] = open(os.path.join(work, fname), "wb")
    except OSError as e:
      raise CheckpointError(
          f"local save of step {step}: process {lay.pid} cannot create its "
          f"step directory {work}: {type(e).__name__}: {e}") from e
    multihost.post_bytes(f"{key}/host", own_host)  # read by our partner
    return plan

  def _plan(self, arrays, manifest) -> dict:
    """Local, no I/O: each leaf's distinct own boxes (offsets in own.bin)
    and the boxes of the replica it receives (offsets in partner.bin) into
    ``manifest``; the exchange's inputs, made of the device buffers as
    they are (no copy), in batches within the budget. Raises
    CheckpointError naming the leaf for what the tier cannot save."""
    lay = self._rounds.layout
    src_devs = lay.devices_of(lay.src[lay.pid])
    own, batches, batch, batch_bytes = [], [], [], 0
    own_off = partner_off = 0
    for name, arr in arrays:
      shape, itemsize = tuple(arr.shape), arr.dtype.itemsize
      shards = {s.device: s for s in arr.addressable_shards}
      missing = [d for d in lay.local if d not in shards]
      if missing:
        raise CheckpointError(
            f"leaf {name}: the local tier saves jax arrays with a shard on "
            f"every device of their process; {missing} of process {lay.pid} "
            f"hold none (sharding {arr.sharding}): put it on a sharding over "
            "every device")
      entry = {"shape": list(shape), "dtype": arr.dtype.name, "slots": [],
               "shards": []}
      seen: dict[tuple, int] = {}
      for d in lay.local:
        s = shards[d]
        idx = box_index(s.index, shape)
        if idx not in seen:
          seen[idx] = len(entry["shards"])
          nb = int(np.prod(s.data.shape)) * itemsize
          entry["shards"].append([idx, own_off, nb, list(s.data.shape)])
          data = s.data
          if d.platform != "cpu":  # CPU: np.asarray is a view, no copy
            data.copy_to_host_async()
          own.append((own_off, nb, data))
          own_off += nb
        entry["slots"].append(seen[idx])
      manifest["own"][name] = entry
      if lay.n == 1:
        continue
      try:
        ss = tuple(arr.sharding.shard_shape(shape))
        imap = arr.sharding.devices_indices_map(shape)
        boxes = [box_index(imap[d], shape) for d in src_devs]
      except (ValueError, KeyError) as e:
        raise CheckpointError(
            f"leaf {name}: the local tier sends each process's shards to its "
            f"partner, which needs equal shards on every process's devices; "
            f"shape {shape} over {arr.sharding} has none: "
            f"{type(e).__name__}: {e}") from e
      nb = int(np.prod(ss)) * itemsize
      entry = {"shape": list(shape), "dtype": arr.dtype.name, "slots": [],
               "shards": []}
      items, seen = [], {}
      for j, idx in enumerate(boxes):
        if idx not in seen:
          seen[idx] = len(entry["shards"])
          entry["shards"].append([idx, partner_off, nb, list(ss)])
          items.append((partner_off, nb, j, ss))
          partner_off += nb
        entry["slots"].append(seen[idx])
      manifest["partner"][name] = entry
      blocks = [shards[d].data for d in lay.local]
      if not ss or not ss[0]:  # 0-d (or empty) blocks get a leading axis
        blocks = [b[None] for b in blocks]
      stacked = lay.join(blocks)
      if batch and batch_bytes + nb * lay.L > self.budget.budget:
        batches.append(batch)
        batch, batch_bytes = [], 0
      batch.append((stacked, items))
      batch_bytes += nb * lay.L
    if batch:
      batches.append(batch)
    return {"own": own, "batches": batches, "own_bytes": own_off,
            "partner_bytes": partner_off}

  def _exchange(self, batches, q, failed, step) -> None:
    """Dispatches each batch's jitted ppermute (asynchronous: this thread
    never waits for another process) and queues the boxes of the replica
    it receives; the writer waits for them, at most barrier_timeout_s.
    Every batch is dispatched, also once the save failed here (the others
    wait for this process's part of the collective); the budget for what a
    batch receives is taken before it is dispatched."""
    lay = self._rounds.layout
    for batch in batches:
      nb = sum(it[1] for _, items in batch for it in items)
      held = self.budget.acquire(nb, failed)
      outs = lay.permute([stacked for stacked, _ in batch])
      deadline = time.monotonic() + self._rounds.timeout_s
      if not held:
        continue
      boxes = []
      for out, (_, items) in zip(outs, batch):
        got = {s.device: s.data for s in out.addressable_shards}
        for offset, n, j, ss in items:
          boxes.append((offset, n, got[lay.local[j]], ss))
      q.put(("wait", 0, ([b[2] for b in boxes], deadline,
                         self._rounds.timeout_s,
                         f"the partner exchange of local step {step}"), 0))
      for offset, n, data, ss in boxes:
        q.put(("partner.bin", offset, (data, ss), n))

  def _write(self, w: LocalWrite, q: queue.Queue,
             failed: threading.Event) -> None:
    """The background part, in steps: write what the caller stages, fsync,
    agree, commit (rename), clean up leftovers and apply retention."""
    # 1. Every box the caller stages written, then fsynced, with
    # host.msgpack and the manifest; a failure is kept for the barrier.
    got = self._write_files(w, q, failed)
    # 2. The partner exchange abandoned: no barrier, and no more saves.
    if got.lost is not None:
      self._abandon(w, got.error)
    # 3. Barrier "written", carrying failures: every process commits or none.
    self._agree(w, got.error)
    # 4. The commit (rename), then retention.
    self._commit(w)

  def _write_files(self, w: LocalWrite, q: queue.Queue,
                   failed: threading.Event) -> _Written:
    """1. Leftovers of earlier saves removed; the boxes written as the
    caller stages them; if all went well, the files made durable. What the
    caller staged goes back to the budget, also after a failure."""
    got = _Written()
    try:
      self._steps.remove_leftovers(keep=os.path.basename(w.work))
      self._steps.remove_unusable()
      self._drain(q, failed, w.files, got)
      if got.error is None:
        self._finish_files(w, got.crcs)
    except BaseException as e:  # pylint: disable=broad-except
      got.error = got.error or e
    finally:
      for f in w.files.values():
        f.close()
      if got.error is not None:
        failed.set()  # the caller stages nothing more
      while not got.drained:  # whatever it staged before it heard, given back
        item = q.get()
        got.drained = item is None
        if not got.drained:
          self.budget.release(item[3])
    return got

  def _drain(self, q: queue.Queue, failed: threading.Event,
             files: dict[str, Any], got: _Written) -> None:
    """Writes each box the caller stages (its crc32c into ``got``) until
    it is done (None); after a failure, only gives the budget back."""
    while True:
      item = q.get()
      if item is None:
        got.drained = True
        return
      kind, offset, data, nb = item
      if kind == "error":
        got.error = got.error or data
        continue
      if kind == "wait":  # also after a failure: was it abandoned?
        try:
          wait_ready(*data)
        except BarrierTimeoutError as e:
          got.lost = e
          got.error = got.error or e
          failed.set()
        continue
      try:
        if got.error is None:
          if kind == "partner.bin":  # ready: a view on CPU, no copy
            data = np.asarray(data[0]).reshape(data[1])
          f = files[kind]
          f.seek(offset)
          # A byte view: memoryview rejects ml_dtypes (bfloat16 ...).
          mv = memoryview(
              np.ascontiguousarray(data).reshape(-1).view(np.uint8))
          got.crcs[(kind, offset)] = crc32c.crc32c(mv)  # of the staged bytes
          f.write(mv)
      except BaseException as e:  # pylint: disable=broad-except
        got.error, _ = e, failed.set()
      finally:
        item = data = None  # nothing of it held past its budget
        self.budget.release(nb)

  def _finish_files(self, w: LocalWrite, crcs: dict[tuple[str, int], int]
                    ) -> None:
    """After the last box: the data files fsynced, host.msgpack (with the
    partner's host values) and the manifest (each file's size, each
    shard's crc32c) written, the directory fsynced."""
    partner_host = b""
    if self._rounds.layout.n > 1:  # posted before the round: no wait
      partner_host = multihost.read_post(
          f"{w.key}/host", w.src, self._rounds.timeout_s,
          f"the host values of process {w.src} for the local tier")
    for f in w.files.values():
      f.flush()
      os.fsync(f.fileno())
    host = msgpack.packb(
        {"own": w.own_host, "partner": partner_host, "partner_src": w.src},
        use_bin_type=True)
    storage_lib.write_file(os.path.join(w.work, "host.msgpack"), host)
    manifest = w.manifest
    manifest["files"] = {"host.msgpack": len(host)}
    manifest["crc32c"] = {"host.msgpack": crc32c.crc32c(host)}
    for part, fname in DATA_FILES.items():
      size = 0
      for e in manifest[part].values():
        for sh in e["shards"]:
          sh.append(crcs[(fname, sh[1])])
          size = max(size, sh[1] + sh[2])
      manifest["files"][fname] = size
    storage_lib.write_file(os.path.join(w.work, "manifest.json"),
                           json.dumps(manifest).encode())
    attempt.fsync_dir(w.work)

  def _abandon(self, w: LocalWrite, error: BaseException) -> NoReturn:
    """2. A process did not join the exchange within barrier_timeout_s: the
    others are not waited for again at the barrier (that would double the
    bound); none commits, as this process never arrives there. Its device
    collectives may now be out of step with the others': it saves no more
    local steps in this job."""
    self._broken = (
        f"process {self._rounds.layout.pid} abandoned the partner exchange "
        f"of local step {w.step} after barrier_timeout_s = "
        f"{self._rounds.timeout_s:g} s "
        "(a process did not join it); its device collectives may be out "
        "of step with the other processes', so the local tier saves no "
        "more steps in this job: restart it")
    shutil.rmtree(w.work, ignore_errors=True)
    multihost.report_failure(f"{w.key}/failed",
                             f"{type(error).__name__}: {error}")
    raise error

  def _agree(self, w: LocalWrite, error: BaseException | None) -> None:
    """3. Barrier "written", carrying each process's failure: after one on
    any process, every process removes its step directory and raises."""
    if error is not None:
      multihost.report_failure(f"{w.key}/failed",
                               f"{type(error).__name__}: {error}")
    multihost.barrier(f"{w.key}/written", timeout_s=self._rounds.timeout_s,
                      what=f"the local tier's save of step {w.step}")
    failures = multihost.reported_failures(f"{w.key}/failed")
    if error is not None or failures:
      shutil.rmtree(w.work, ignore_errors=True)
      if error is not None:
        raise error
      raise CheckpointError(f"local save of step {w.step} failed on "
                            f"process(es) {sorted(failures)}: {failures}")

  def _commit(self, w: LocalWrite) -> None:
    """4. The step directory renamed into place (a step saved again: the
    old one removed first), retention, the log line."""
    home = self._steps.dir
    final = os.path.join(home, f"step_{w.step}")
    if os.path.exists(final):  # saved again: the old one goes first
      remove_step(final, home, w.step)
    os.rename(w.work, final)
    attempt.fsync_dir(home)
    total_s = time.perf_counter() - w.t0
    self.last_save_stats["total_s"] = total_s
    self._steps.retain()
    own, replica = (w.manifest["files"]["own.bin"],
                    w.manifest["files"]["partner.bin"])
    logging.info("ckpt: saved step %d to the local tier %s: this process "
                 "wrote %s (%s of it its partner's replica) in %.2f s (%s)",
                 w.step, home, size_text(own + replica), size_text(replica),
                 total_s, rate_text(own + replica, total_s))
