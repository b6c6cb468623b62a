"""The writer process of one host (``Checkpointer(..., writer="process")``).

Started by its trainer (ckpt/save/handed.py) as ``python -m
ckpt.save.writer_main FD`` (a new interpreter, never a fork of a JAX
process), with ``FD`` its end of the socket pair. It never initializes
jax.distributed nor any device: it writes bytes with TensorStore and
commits through the storage. Call sequence, one save at a time
(ckpt/save/handover.py has the messages): ``begin`` opens the arrays (and,
when it commits, renews the attempt's lease), each ``box`` is written from
its shared memory as it comes (under the save's budget: the trainer stages
no more than ``concurrent_bytes`` ahead of the ``freed`` replies; format
"ocdbt": the boxes between two ``flush`` in one transaction), then
``finish``: every write ended, this process's files written, and the step
committed when the writer commits (one process); ``done`` or ``failed``.

Its trainer gone (EOF on the socket, or its pid no longer the parent): a
save whose ``finish`` arrived is finished (and committed when the writer
commits); one still being handed over is abandoned; then the writer exits,
and never starts another save. Every path unlinks the shared memory it was
handed (and, on exit, any of its trainer's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import socket
import sys
import threading
import time

import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy)
from absl import logging
import msgpack
import numpy as np
import tensorstore as ts

from ckpt.commit import strategy
from ckpt.commit import through_storage
from ckpt.errors import CheckpointError
from ckpt.format import index as index_lib
from ckpt.format import seal
from ckpt.save import handover
from ckpt.save import writer_host
from ckpt.save import writer_packs
from ckpt.save import writer_reuse
from ckpt.save.write import chunk_sums
from ckpt.shards import plan as plan_lib
from ckpt.store import deadline as deadline_lib
from ckpt.store import ocdbt
from ckpt.store import storage as storage_lib
from ckpt.store import tsfuture

WRITE_THREADS = 8


class Save:
  """One save handed over by the trainer (see the module docstring)."""

  def __init__(self, begin: dict, channel: handover.Channel,
               reuser: writer_reuse.WriterReuser):
    self.msg = begin
    self.channel = channel
    self.job = begin["job"]
    self.step, self.token = begin["step"], begin["token"]
    self.work_dir = begin["work_dir"]
    self.storage = storage_lib.Storage(begin["url"], begin["storage_options"])
    self.context = self.storage.context()
    # save_timeout_s, as the trainer's writes would have it (stalls only).
    self.deadline = deadline_lib.Deadline.start(
        begin["save_timeout_s"], "save_timeout_s",
        f"writing step {self.step} to {self.storage.url!r}",
        on_wire=not self.storage.is_posix)
    self.take_sums = begin["take_sums"]
    self.pool = concurrent.futures.ThreadPoolExecutor(WRITE_THREADS)
    self.lock = threading.Lock()
    self.writes: list[concurrent.futures.Future] = []
    self.sums: list[list] = []
    self.bytes_written = 0
    self.error: BaseException | None = None
    self.stopped = False     # cancelled, or the trainer gone mid-hand-over
    self.committing = False
    self.committed = False
    self.finishing: threading.Thread | None = None
    self.process, self.processes = begin["process"], begin["processes"]
    self.files: dict[str, bytes] = {}  # this process's small files, written
    self.recorded = False  # its record (through_storage) is written
    self.stop_event = threading.Event()  # cancel: no commit, no more waits
    self.renewal = None
    # reuse_unchanged=True: linked as the thread links (writer_reuse.py)
    self.reuser, self.reuse = reuser, None
    self.reuse_loop = (writer_reuse.LoopThread() if begin.get("reuse_copies")
                       else None)
    if self.process == 0:  # process 0's writer holds the lease from now on
      self.renewal = through_storage.hold_lease(
          self.storage, self.step, self.token, begin["lease_s"])
    # Format "ocdbt": the boxes handed over since the last "flush".
    self.batch = [] if begin["storage_format"] == "ocdbt" else None
    self.opening = self.pool.submit(deadline_lib.call, self.deadline,
                                    self._open_arrays)
    self.packs = writer_packs.PackSink(
        self.storage.step_spec(self.work_dir), self.context, self.process)

  # ---- the boxes -------------------------------------------------------

  def _open_arrays(self) -> dict[int, ts.TensorStore]:
    if self.reuse_loop is not None:  # before the first link
      self.reuse = self.reuser.begin(self.storage, self.msg)
      if self.reuse is not None:
        self.reuse.check_source()
    out = {}
    # OCDBT: the metadata in one atomic transaction: one commit (write.py).
    txn = ts.Transaction(atomic=True) if self.batch is not None else None
    for a in self.msg["arrays"]:
      if a["create"]:
        out[a["id"]] = ts.open(a["spec"], create=True, context=self.context,
                               transaction=txn)
      else:
        out[a["id"]] = ts.open(a["spec"], open=True, assume_metadata=True,
                               context=self.context)
    out = {i: deadline_lib.result(f) for i, f in out.items()}
    if txn is not None:
      deadline_lib.result(txn.commit_async())
      out = {i: a.with_transaction(None) for i, a in out.items()}
    return out

  def box(self, m: dict) -> None:
    if self.batch is not None:  # "ocdbt": written at the next flush
      self.batch.append(m)
      return
    self.writes.append(self.pool.submit(deadline_lib.call, self.deadline,
                                        self._write_box, m))

  def flush(self) -> None:
    """Format "ocdbt": the boxes handed over since the last flush written
    in one transaction (flushed where the thread would: budget full, end)."""
    if self.batch:
      ms, self.batch = self.batch, []
      self.writes.append(self.pool.submit(deadline_lib.call, self.deadline,
                                          self._write_batch, ms))

  def _write_batch(self, ms: list[dict]) -> None:
    """One OCDBT commit for the batch (``ocdbt.write_batch``, as the
    thread's): a data file and a few B+tree nodes, not a commit per box;
    each box freed once the batch is committed (or failed)."""
    segs, failed = [], False
    try:
      if self.stopped or self.error is not None:
        return
      stores = self.opening.result()
      writes = []
      for m in ms:
        segs.append(handover.Segment(m["shm"], m["nbytes"], create=False))
        writes.append(functools.partial(
            self._write_in, stores[m["array"]], m,
            segs[-1].array(m["shape"], m["dtype"])))
      asyncio.run(ocdbt.write_batch(writes, lambda: (
          f"{len(ms)} boxes of leaves {sorted({m['leaf'] for m in ms})[:5]} "
          f"to the OCDBT database of process {self.process}")))
      with self.lock:
        self.bytes_written += sum(m["nbytes"] for m in ms)
    except BaseException as e:  # pylint: disable=broad-except
      failed = True
      self._note_error(e)
    finally:
      writes = None  # the views of the segments dropped
      for seg in segs:
        seg.close()
      for m in ms:
        handover.unlink(m["shm"])
      # One reply: the batch's bytes back in the budget at once (as thread)
      self._tell("freed", grants=[m["grant"] for m in ms], failed=failed)

  async def _write_in(self, store: ts.TensorStore, m: dict, data: np.ndarray,
                      txn: ts.Transaction) -> None:
    box = plan_lib.Box(tuple(m["start"]), tuple(m["stop"]))
    try:
      # ``data`` (never changed; its view keeps the mapping) not copied.
      await tsfuture.wait(store.with_transaction(txn)[box.slices()].write(
          data, can_reference_source_data_indefinitely=True))
    except Exception as e:
      raise CheckpointError(f"leaf {m['leaf']!r}: writing {box.start}.."
                            f"{box.stop} failed: {e}") from e
    if self.take_sums:
      self._add_sums(m, chunk_sums(box, tuple(m["chunks"]), data))

  def _add_sums(self, m: dict, crcs) -> None:
    with self.lock:
      self.sums.extend([m["leaf_id"], list(b.start), list(b.stop), crc]
                       for b, crc in crcs)

  def pack(self, m: dict) -> None:
    """A pack of small leaves (ckpt/save/writer_packs.py)."""
    self.writes.append(self.pool.submit(deadline_lib.call, self.deadline,
                                        self._write_box, m, True))

  def _write_box(self, m: dict, packed: bool = False) -> None:
    name = m["shm"]
    failed = False
    try:
      if self.stopped or self.error is not None:
        return
      seg = handover.Segment(name, m["nbytes"], create=False)
      try:
        if packed:
          data = seg.array([m["nbytes"]], "uint8")
          self.packs.write(m, memoryview(data))
          del data
          with self.lock:
            self.bytes_written += m["data_bytes"]
          return
        data = seg.array(m["shape"], m["dtype"])
        box = plan_lib.Box(tuple(m["start"]), tuple(m["stop"]))
        store = self.opening.result()[m["array"]]
        linked = 0
        try:
          if self.reuse is not None:
            crcs, linked = self.reuse_loop.run(self.reuse.write_box(
                store, m["array"], box, tuple(m["chunks"]), data,
                self.take_sums))
          else:
            deadline_lib.result(store[box.slices()].write(data))
            crcs = (chunk_sums(box, tuple(m["chunks"]), data)
                    if self.take_sums else [])
        except Exception as e:
          raise CheckpointError(
              f"leaf {m['leaf']!r}: writing {box.start}..{box.stop} failed: "
              f"{e}") from e
        del data
      finally:
        seg.close()
      self._add_sums(m, crcs)
      with self.lock:
        self.bytes_written += m["nbytes"] - linked
    except BaseException as e:  # pylint: disable=broad-except
      failed = True
      self._note_error(e)
    finally:
      handover.unlink(name)
      self._tell("freed", grant=m["grant"], failed=failed)

  def _note_error(self, e: BaseException) -> None:  # the first is told
    with self.lock:
      if self.error is None:
        self.error = e

  def _tell(self, kind: str, **fields) -> None:
    try:
      self.channel.send(kind, job=self.job, **fields)
    except OSError:
      pass  # the trainer is gone: what it would have heard no longer matters

  # ---- the end ---------------------------------------------------------

  def finish(self, m: dict) -> None:
    self.flush()
    self.finishing = threading.Thread(target=self._finish, args=(m,),
                                      name="ckpt-writer-finish", daemon=True)
    self.finishing.start()

  def _finish(self, m: dict) -> None:
    try:
      concurrent.futures.wait(self.writes)
      deadline_lib.call(self.deadline, self._files, m)
      # Its part durable: its record, then process 0's writer commits once
      # every record is in (ckpt/commit/through_storage.py).
      deadline_lib.call(self.deadline, lambda: through_storage.write_record(
          self.storage, self.step, self.token, self.process, self.processes,
          files=self.files, tiling=m["tiling"]))
      self.recorded = True
      committed = self._commit(m)
      self.reuser.committed(self.reuse)  # the next save compares with it
      reuse = self.reuse
      self._tell("done", bytes_written=self.bytes_written,
                 committed=committed,
                 bytes_reused=reuse.bytes_reused if reuse else 0,
                 chunks_reused=reuse.chunks_reused if reuse else 0)
    except BaseException as e:  # pylint: disable=broad-except
      logging.warning("ckpt writer process: the save of step %d failed: "
                      "%s: %s", self.step, type(e).__name__, e)
      self._record_failure(e)
      self._tell("failed", **handover.error_message(e))
    finally:
      self._end()

  def _files(self, m: dict) -> None:
    """Every array exists (even with no box here), every box was written;
    then this process's small files."""
    self.opening.result()
    if self.error is not None:
      raise self.error
    self.packs.finish()
    if self.reuse is not None:  # still ours, now that every link is made?
      self.reuse.check_source()
      self._write_file(index_lib.REUSE_DIR, self.reuse.record_file(
          self.process, self.bytes_written))
    if self.take_sums:
      self._write_file(index_lib.CHECKSUMS_DIR, msgpack.packb(
          {"process": self.process, "boxes": self.sums}, use_bin_type=True))
    for f in self.msg["host_files"]:
      self._write_file(index_lib.HOST_STATE_DIR, f["data"], f["process"])

  def _commit(self, m: dict) -> bool:
    """Process 0's writer: the commit, once every record is in; the others:
    whether it committed (both within the bound)."""
    with self.lock:
      if self.stopped:
        raise CheckpointError(f"the save of step {self.step} was "
                              "cancelled before its commit")
      self.committing = self.process == 0
    bound = m["bound_s"]
    if self.process == 0:
      renewal, self.renewal = self.renewal, None
      deadline_lib.call(self.deadline, lambda: (
          through_storage.commit_when_written(
              self.storage, self.step, self.token, self.processes,
              lambda: self._merged(m), bound_s=bound, renewal=renewal,
              whole=m["whole"], stop=self.stop_event)))
    elif not self._wait_committed(2 * bound):
      raise CheckpointError(
          f"step {self.step} was not committed by process 0's writer within "
          f"{2 * bound:g} s of this writer's record (it failed, or died; "
          f"its process says which), or that writer is gone")
    self.committed = True
    return True

  def _merged(self, m: dict) -> bytes:
    """Process 0's writer, every record in: format "ocdbt", the processes'
    databases merged into the step's (each merge group's), as the
    trainers' commit does (ckpt/store/ocdbt.py); then the index."""
    groups = m["ocdbt_groups"]
    if groups:
      kvstore = self.storage.step_spec(self.work_dir)
      for g in [None] if groups == 1 else range(groups):
        asyncio.run(ocdbt.merge(kvstore, self.processes, self.context, g))
    return m["index"]

  def _wait_committed(self, bound_s: float) -> bool:
    """Whether process 0's writer committed the step within ``bound_s``;
    False at once when its own record says it failed (its trainer died
    before the hand-over ended: it never commits), or when the attempt can
    no longer commit (process 0's writer died on this host, or the
    attempt is gone)."""
    t0 = time.monotonic()
    key = through_storage.record_key(self.work_dir, 0)
    while True:
      left = bound_s - (time.monotonic() - t0)
      if through_storage.wait_committed(self.storage, self.step, self.token,
                                        max(0.0, min(1.0, left)),
                                        stop=self.stop_event):
        return True
      if (left <= 0 or self.stop_event.is_set() or self._failed_record(key)
          or through_storage.never_commits(self.storage, self.step,
                                           self.token)):
        return False

  def _failed_record(self, key: str) -> bool:
    try:
      data = self.storage.read_bytes(key, limit=through_storage.MAX_RECORD_BYTES)
      if data is None:
        return False
      doc = msgpack.unpackb(seal.unseal(data, key), raw=False)
    except Exception:  # pylint: disable=broad-except
      return False  # damaged: process 0's writer says so itself
    return (isinstance(doc, dict) and doc.get("attempt") == self.token
            and doc.get("step") == self.step and doc.get("ok") is False)

  def _record_failure(self, e: BaseException) -> None:
    """A writer that failed before its record says so in one, so process
    0's writer stops waiting and commits nothing."""
    if self.recorded:
      return
    try:
      through_storage.write_record(
          self.storage, self.step, self.token, self.process, self.processes,
          error=f"{type(e).__name__}: {e}")
      self.recorded = True
    except Exception as e2:  # pylint: disable=broad-except
      logging.warning("ckpt writer process: could not record the failure "
                      "of step %d: %s", self.step, e2)

  def _write_file(self, kind: str, data: bytes, pid: int | None = None) -> None:
    pid = self.process if pid is None else pid
    rel = index_lib.process_file(kind, pid)
    what = (f"the {kind.lstrip('.')} file of process {pid}, step "
            f"{self.step},")
    data = seal.seal(data)
    self.files[rel] = data
    if len(data) > index_lib.MAX_PROCESS_FILE_BYTES:
      raise CheckpointError(
          f"{what} is {len(data)} bytes; readers accept at most "
          f"{index_lib.MAX_PROCESS_FILE_BYTES}")
    strategy.for_storage(self.storage).write_into_attempt(
        self.work_dir, rel, data, what)

  def stop(self) -> bool:
    """Cancelled (or the trainer gone before ``finish``): no box starts,
    the writes started end; whether the step was committed meanwhile."""
    with self.lock:
      self.stopped = True
      committing = self.committing
    self.stop_event.set()  # a wait for the records or the commit ends
    if self.batch:  # never to be written: freed
      for m in self.batch:
        handover.unlink(m["shm"])
      self._tell("freed", grants=[m["grant"] for m in self.batch],
                 failed=True)
      self.batch = []
    if self.finishing is not None and committing:
      self.finishing.join()
    concurrent.futures.wait(self.writes)
    if self.finishing is None:
      # Its record says so: process 0's writer stops waiting for it.
      self._record_failure(CheckpointError(
          f"the save of step {self.step} was cancelled, or its trainer died, "
          "before it was handed over whole"))
      self._end()
    return self.committed

  def _end(self) -> None:
    if self.renewal is not None:
      self.renewal.stop()
      self.renewal = None
    self.pool.shutdown(wait=False)
    if self.reuse_loop is not None:
      self.reuse_loop.close()


def serve(channel: handover.Channel, trainer: int, nonce: str) -> None:
  """Reads the trainer's messages until it says ``exit`` or is gone."""
  save: Save | None = None
  reuser = writer_reuse.WriterReuser()  # across saves: what they stored
  # What trainers and writers that both died left (not this trainer's: it
  # may have died with segments this writer has still to read).
  handover.sweep(spare=trainer)
  watch = threading.Thread(target=writer_host.watch_parent,
                           args=(channel, trainer),
                           daemon=True)
  watch.start()
  try:
    while True:
      m = channel.receive()
      kind = None if m is None else m["kind"]
      if kind is None or kind == "exit":
        break
      if kind == "begin":
        try:
          save = Save(m, channel, reuser)
        except BaseException as e:  # pylint: disable=broad-except
          save = None
          channel.send("failed", job=m["job"], **handover.error_message(e))
        else:
          if save.renewal is not None:
            # Process 0's trainer returns from save() only after this: the
            # lease names this live writer, never only a trainer that may
            # die next (a restarted job's cleanup would take it for dead).
            channel.send("held", job=m["job"])
      elif save is None:
        if kind in ("box", "pack"):  # a save that could not begin: freed
          handover.unlink(m["shm"])
          channel.send("freed", job=m["job"], grant=m["grant"], failed=True)
        elif kind == "cancel":
          channel.send("cancelled", job=m["job"], committed=False)
      elif kind == "box":
        save.box(m)
      elif kind == "pack":
        save.pack(m)
      elif kind == "flush":
        save.flush()
      elif kind == "finish":
        save.finish(m)
      elif kind == "cancel":
        channel.send("cancelled", job=m["job"], committed=save.stop())
        save = None
    # The trainer is gone, or closing: a save it finished handing over is
    # finished; one it was handing over is abandoned. Then no other.
    if save is not None:
      if save.finishing is not None:
        save.finishing.join()
      else:
        save.stop()
  finally:
    handover.sweep(trainer, nonce)


def main(argv: list[str]) -> int:
  fd, trainer, nonce = int(argv[1]), int(argv[2]), argv[3]
  nice = os.environ.get(handover.NICE_ENV)
  if nice and nice.lstrip("-").isdigit() and hasattr(os, "setpriority"):
    writer_host.lower_priority(int(nice))
  channel = handover.Channel(socket.socket(fileno=fd))
  serve(channel, trainer, nonce)
  return 0


if __name__ == "__main__":
  np.seterr(all="ignore")
  sys.exit(main(sys.argv))
