"""The local tier of multi-tier checkpoints (ckpt/tiers/multitier.py composes it
with a persistent ``Checkpointer``):

- the persistent tier: a plain ``ckpt.Checkpointer`` on any URL, saved every
  ``persistent_interval`` steps, keeping ``persistent_keep``;
- the local tier (``LocalTier``, this module): every ``local_interval`` steps
  each process writes the shards it holds to a directory on its own host
  (``<local>/process_<i>/``; no shared file system is assumed), plus a replica
  of the shards of one partner process, received with a jitted
  ``jax.lax.ppermute`` over all devices dispatched on the caller's thread
  inside ``save()`` (not waited for there). Everything of a save that can
  fail on one process alone (the plan, the step directory and its files,
  the host values posted for the partner) comes before the start round, so
  every process raises together or none does; the background thread waits
  for the exchange (at most ``barrier_timeout_s``), writes, agrees,
  commits and applies retention.

Local tier on disk (one directory per process)::

  <local>/process_<i>/
    step_<N>/                  committed: every process wrote its part of N
      manifest.json            format, step, process count/index, partner,
                               the persistent root it belongs to (owner),
                               the size of each file, the crc32c of
                               host.msgpack; per leaf: shape, dtype, shards
                               (index, offset, bytes, shape, crc32c)
      own.bin                  this process's distinct shards, back to back
      partner.bin              the shards of process ``src`` (its partner)
      host.msgpack             host_state and host values: own and partner's
    step_<N>.tmp-<token>/      being written, or left by a crash: removed at
                               the next save of this process

A step becomes ``step_<N>`` on a process only after a barrier that every
process reaches once its own part and its partner replica are written and
fsynced (a process that failed says so before the barrier, and then no one
commits; a process whose exchange did not complete within
``barrier_timeout_s`` skips the barrier and refuses every later local save
of the job: its device collectives may be out of step). So when any process
holds ``step_<N>``, every process has committed ``N - 1`` (saves are
serialized), which is why ``local_keep >= 2`` is
required: retention can never delete the newest step the job can rebuild.

Restore: each process posts the local steps it can serve for the target
(own part, partner replica: a valid manifest of this persistent root and
topology, the target's shardings, and for the steps that can be chosen
every file's size and every shard's crc32c, verified before the round, so a
bad file moves every process's decision to the partner's replica or the
persistent tier, with the reason); process 0 takes the newest step for which every process
has its own part or its partner holds a replica of it, compares it with the
newest persistent step, and every process restores the same one. Processes
whose own part is missing get it back from their partner with the inverse
``ppermute``.

Leaves mean what they mean to a ``Checkpointer`` (``_prepare_leaves``,
``_restore_plan``): the same names, ``save_dtype`` / ``restore_dtype``
casts of floating leaves (with numpy, so both tiers hold the same bits),
typed PRNG keys stored as key data with their implementation, arrays one
process holds whole (an uncommitted ``jnp.asarray(10)``) as host values, and
the same refusals (TreeMismatchError naming the leaf: a float32 leaf into an
int32 target, another shape, keys of another implementation) raised by
every process before the exchange, not a fall back to another step.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import queue
import re
import shutil
import threading
import time
from typing import Any, NamedTuple

import crc32c
import msgpack
import numpy as np
from absl import logging

import jax

from ckpt.commit import protocol as commit_lib
from ckpt.format import index as index_lib
from ckpt.restore import lazy
from ckpt.multihost import process as multihost
from ckpt.tiers import partner
from ckpt.format import prng
from ckpt.restore import read as restore_lib
from ckpt.save import write as save_lib
from ckpt.format import saved_sharding as saved_sharding_lib
from ckpt.store import storage as storage_lib
from ckpt.format import tree as tree_lib
from ckpt.checkpointer import DEFAULT_CONCURRENT_BYTES
from ckpt.errors import (BarrierTimeoutError, CheckpointError,
                         CorruptCheckpointError, InvalidStateError,
                         MissingLeavesError, TreeMismatchError)

FORMAT = "ckpt-local-tier"
VERSION = 3   # 2: crc32c of every shard and of host.msgpack, file sizes, owner
# 3: leaves named as the persistent tier names them ("params/w"); host.msgpack
# holds each stored leaf's dtype and PRNG implementation, and host values
# encoded as the persistent tier's index encodes inline values
MAX_MANIFEST_BYTES = 32 << 20   # as MAX_INDEX_BYTES of the persistent tier
_DATA_FILES = {"own": "own.bin", "partner": "partner.bin"}
_CRC_CHUNK = 64 << 20   # bytes read at a time to verify a shard
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^step_\d+\.(tmp|del)-[0-9a-f]+$")
MAX_HOST_BYTES = 16 << 20   # host_state + host values sent to the partner


# ---- a byte budget for the caller and the writer thread ------------------------

class _Budget:
  """Bytes staged on the host and not yet written. An item larger than the
  budget waits until nothing else is held, then proceeds alone."""

  def __init__(self, budget: int):
    self.budget, self.used, self.peak = int(budget), 0, 0
    self._cv = threading.Condition()

  def acquire(self, n: int, failed: threading.Event) -> bool:
    """Takes ``n`` bytes once they fit; False, taking nothing, once the save
    has failed: the caller then stages nothing more (it still joins the
    partner exchange, a collective), so a failed save drains within the
    budget too, and never waits for a writer that stopped."""
    with self._cv:
      while self.used and self.used + n > self.budget:
        if failed.is_set():
          return False
        self._cv.wait(0.1)
      if failed.is_set():
        return False
      self.used += n
      self.peak = max(self.peak, self.used)
      return True

  def release(self, n: int) -> None:
    with self._cv:
      self.used -= n
      self._cv.notify_all()


def _wait_ready(arrays, deadline: float, timeout_s: float, what: str) -> None:
  """Returns once every array is ready; BarrierTimeoutError at
  ``deadline`` (time.monotonic()): a process did not join the collective
  that makes them."""
  pending, pause = list(arrays), 1e-4
  while True:
    pending = [a for a in pending if not a.is_ready()]
    if not pending:
      return
    now = time.monotonic()
    if now >= deadline:
      raise BarrierTimeoutError(
          f"{what} (a ppermute with every process) did not complete within "
          f"barrier_timeout_s = {timeout_s:g} s of its dispatch on process "
          f"{multihost.process_index()} of {multihost.process_count()}: a "
          "process did not join it (stuck, stopped, dead, or still busy "
          "with its previous work); look at the logs of the other processes")
    time.sleep(min(pause, deadline - now))
    pause = min(2 * pause, 0.01)


# ---- leaves -----------------------------------------------------------------

def _index(idx, shape) -> tuple:
  return tuple((s.start or 0, shape[d] if s.stop is None else s.stop)
               for d, s in enumerate(idx))


def flatten(tree):
  """[(name, leaf)] named as the persistent tier names leaves ("params/w",
  ckpt/format/tree.py: so both tiers' errors name a leaf alike), and the treedef."""
  return ([(tree_lib.path_str(p), v) for p, v in tree_lib.flatten(tree)],
          jax.tree_util.tree_structure(tree))


def _prepare_leaves(leaves, save_dtype, devices) -> tuple[list, dict, dict]:
  """The leaves of a local save, stored as a ``Checkpointer`` stores them
  (ckpt/save/write.py ``plan_save``), or refused with its error naming the leaf.

  Returns ``(arrays, host_vals, info)``:

  - ``arrays``: ``[(name, jax.Array)]``, the leaves with a shard on every
    device of the job, in the dtype they are stored in: floating leaves cast
    to ``save_dtype`` on the host with numpy, as the persistent tier casts
    (so both tiers hold the same bits), typed PRNG keys as their key data;
  - ``host_vals``: ``{name: index.encode_value(...)}``, numpy and Python
    values and the jax arrays one process holds whole (an uncommitted
    ``jnp.asarray(10)`` lives on one device of each process: a host value
    of each, as the persistent tier stores it inline), cast as above;
  - ``info``: ``{"arrays": {name: [dtype, shape]}, "prng": {name: impl},
    "device": [names of the host values that were one-device jax arrays]}``,
    saved with the host values, so every process (one restoring from its
    partner too) knows each leaf's stored dtype and PRNG implementation.

  Raises InvalidStateError naming the leaf for what a Checkpointer refuses,
  for an array whose shards are uneven, and for one on some devices only.
  """
  job = set(devices)
  arrays, host_vals = [], {}
  info: dict[str, Any] = {"arrays": {}, "prng": {}, "device": []}
  for name, x in leaves:
    if isinstance(x, jax.Array):
      if prng.is_key_dtype(x.dtype):  # stored as its key data (ckpt/format/prng.py)
        info["prng"][name], x = save_lib._key_data(name, x)  # pylint: disable=protected-access
      stored = save_lib._leaf_dtype(name, x.dtype, save_dtype)  # pylint: disable=protected-access
      if x.sharding.device_set != job:
        if not x.is_fully_addressable:
          raise InvalidStateError(
              f"leaf {name!r} is on {len(x.sharding.device_set)} of the job's "
              f"{len(job)} devices, spread over processes; the local tier "
              "stores arrays with a shard on every device, or held whole by "
              "each process")
        host_vals[name] = index_lib.encode_value(
            np.asarray(x).astype(stored), (name,))
        info["device"].append(name)  # restored as saved: on one device
        continue
      try:  # the partner exchange stacks equal shards
        x.sharding.shard_shape(tuple(x.shape))
      except ValueError as e:
        raise InvalidStateError(
            f"leaf {name!r} has uneven shards (shape {tuple(x.shape)}, "
            f"{x.sharding}), which the local tier cannot store: {e}") from e
      if stored != x.dtype:
        x = jax.make_array_from_single_device_arrays(
            x.shape, x.sharding,
            [jax.device_put(np.asarray(s.data).astype(stored), s.device)
             for s in x.addressable_shards])
      arrays.append((name, x))
      info["arrays"][name] = [stored.name, list(x.shape)]
    elif isinstance(x, np.ndarray):
      stored = save_lib._leaf_dtype(name, x.dtype, save_dtype)  # pylint: disable=protected-access
      host_vals[name] = index_lib.encode_value(x.astype(stored), (name,))
    elif isinstance(x, (bool, int, float, str, bytes, np.generic)):
      if isinstance(x, np.generic):
        stored = save_lib._leaf_dtype(name, x.dtype, save_dtype, inline=True)  # pylint: disable=protected-access
        x = np.asarray(x).astype(stored)[()]
      host_vals[name] = index_lib.encode_value(x, (name,))
    else:
      raise InvalidStateError(
          f"leaf {name!r} is a {type(x).__module__}.{type(x).__qualname__}; "
          "expected a jax.Array, numpy array, scalar, str, bytes or None. "
          "Register custom containers as pytree nodes.")
  return arrays, host_vals, info


# ---- the local tier ------------------------------------------------------------

class LocalTier:
  """Per-host saves with a partner replica; see the module docstring."""

  def __init__(self, directory: str | os.PathLike, *, keep: int = 2,
               concurrent_bytes: int = DEFAULT_CONCURRENT_BYTES,
               barrier_timeout_s: float = multihost.DEFAULT_TIMEOUT_S,
               owner: str = "", save_dtype: Any = None,
               restore_dtype: Any = None):
    if keep is None or int(keep) < 2:
      raise ValueError(f"local_keep must be >= 2 (the newest step the job can "
                       f"rebuild may be the one before the newest), got {keep!r}")
    self.keep = int(keep)
    # The persistent tier this local tier belongs to: steps of another are
    # never restored and are removed at the next save.
    self.owner = str(owner)
    # As the persistent tier's (Checkpointer save_dtype / restore_dtype):
    # floating leaves cast before they are stored / after they are read.
    self.save_dtype, self.restore_dtype = save_dtype, restore_dtype
    self.root = os.path.abspath(os.fspath(directory))
    self.pid = multihost.process_index()
    self.dir = os.path.join(self.root, f"process_{self.pid}")
    os.makedirs(self.dir, exist_ok=True)
    self.budget = _Budget(concurrent_bytes)
    self.timeout_s = barrier_timeout_s
    # The same on every process (never hash(): it is salted per process).
    self._key_base = "local-" + hashlib.sha1(
        os.fspath(directory).encode()).hexdigest()[:16]
    self._pool = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="ckpt-local")
    self._fut: concurrent.futures.Future | None = None
    self._layout: partner.Layout | None = None
    self._round_keys: list[str] = []  # deleted at the next round
    self._broken = ""  # why this process saves no more (an abandoned exchange)
    self.last_save_stats: dict = {}
    self.last_restore_stats: dict = {}

  @property
  def layout(self) -> partner.Layout:
    if self._layout is None:
      # Collective (the hosts' round): built at the first save or restore,
      # which every process calls.
      self._layout = partner.Layout(self._key_base, self.timeout_s)
    return self._layout

  # -- listing --

  def committed_steps(self) -> list[int]:
    try:
      names = os.listdir(self.dir)
    except FileNotFoundError:
      return []
    return sorted(int(m.group(1)) for m in map(_STEP_RE.match, names) if m)

  def _manifest(self, step: int) -> dict:
    """The validated manifest of ``step`` (this process's); raises
    CorruptCheckpointError naming the file, what was expected and found."""
    path = os.path.join(self.dir, f"step_{step}", "manifest.json")
    try:
      with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
      raise CorruptCheckpointError(
          f"local step {step}: cannot read {path}: {e}") from e
    if len(data) > MAX_MANIFEST_BYTES:
      raise CorruptCheckpointError(
          f"local step {step}: {path} has more than MAX_MANIFEST_BYTES = "
          f"{MAX_MANIFEST_BYTES} bytes: not a manifest of the local tier")
    try:
      m = json.loads(data)
    except ValueError as e:
      raise CorruptCheckpointError(
          f"local step {step}: {path} is not JSON ({len(data)} bytes): "
          f"{str(e)[:200]}") from e
    check_manifest(m, step, self.pid, path)
    return m

  def _foreign(self, m: dict) -> str:
    """Why a valid manifest belongs to another run ('' if it is ours)."""
    lay = self.layout
    if m["owner"] != self.owner:
      return (f"it was saved for the persistent tier {m['owner']!r}, this "
              f"job's is {self.owner!r} (a local directory left by another "
              "run)")
    if m["process_count"] != lay.n or m["local_devices"] != lay.L:
      return (f"it was saved by {m['process_count']} processes x "
              f"{m['local_devices']} devices, this job has {lay.n} x {lay.L}")
    return ""

  def _remove_unusable(self) -> None:
    """At a save (writer thread, local only): committed steps of another
    run (persistent root, topology) or with a bad manifest go: they are
    never restored, and retention must not keep them over this run's."""
    for s in self.committed_steps():
      try:
        why = self._foreign(self._manifest(s))
      except CorruptCheckpointError as e:
        why = str(e)
      if why:
        path = os.path.join(self.dir, f"step_{s}")
        logging.info("ckpt: local tier removes %s: %s", path, why)
        try:
          _remove(path, self.dir, s)
        except OSError as e:
          logging.warning("ckpt: local tier could not remove %s: %s", path, e)

  def _verify(self, step: int, m: dict, part: str | None) -> str:
    """'' if the data file of ``part`` (None: host.msgpack) of ``step``
    has the size and every shard the crc32c its manifest records; else why
    (naming the file, what was expected and what was found)."""
    base = os.path.join(self.dir, f"step_{step}")
    fname = "host.msgpack" if part is None else _DATA_FILES[part]
    path = os.path.join(base, fname)
    want = m["files"][fname]
    try:
      size = os.path.getsize(path)
    except OSError as e:
      if want == 0 and isinstance(e, FileNotFoundError):
        return ""
      return f"local step {step}: cannot read {path}: {e}"
    if size != want:
      return (f"local step {step}: {path} is {size} bytes, its manifest says "
              f"{want} (truncated or overwritten)")
    if part is None:
      spans = [(0, size, m["crc32c"]["host.msgpack"], "host values")]
    else:
      spans = [(sh[1], sh[2], sh[4], f"leaf {name} shard {k}")
               for name, e in m[part].items()
               for k, sh in enumerate(e["shards"])]
    try:
      with open(path, "rb") as f:
        for off, nb, crc, what in sorted(spans):
          f.seek(off)
          got, left = 0, nb
          while left:
            chunk = f.read(min(left, _CRC_CHUNK))
            if not chunk:
              return (f"local step {step}: {path} ended at byte "
                      f"{off + nb - left}, {what} ends at {off + nb}")
            got = crc32c.crc32c(chunk, got)
            left -= len(chunk)
          if got != crc:
            return (f"local step {step}: {path}: {what} (bytes {off}.."
                    f"{off + nb}) has crc32c {got:#010x}, its manifest says "
                    f"{crc:#010x} (the file is corrupt)")
    except OSError as e:
      return f"local step {step}: cannot read {path}: {e}"
    return ""

  # -- save --

  def wait(self) -> None:
    fut, self._fut = self._fut, None
    if fut is not None:
      fut.result()

  def save(self, step: int, state: Any, host_state: Any = None) -> None:
    # The key first: a failure below on one process (the previous save's
    # too) goes into the round, so no later key drifts.
    key = multihost.call_key(self._key_base, "save", step)
    t0 = time.perf_counter()
    lay = self.layout
    token = multihost.unique_token()
    work = os.path.join(self.dir, f"step_{step}.tmp-{token}")
    src = lay.src[lay.pid]
    manifest = {"format": FORMAT, "version": VERSION, "step": step,
                "process_count": lay.n, "process": lay.pid,
                "local_devices": lay.L, "partner_src": src, "own": {},
                "partner": {}, "host_names": [], "owner": self.owner}
    host_vals, arrays, error = {}, [], None
    try:
      self.wait()
      arrays, host_vals, info = _prepare_leaves(flatten(state)[0],
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
                       self.timeout_s)
    except BaseException:
      for f in files.values():
        f.close()
      shutil.rmtree(work, ignore_errors=True)  # this save's own (token)
      self._round_keys.append(key)  # deleted at the next round that passes
      raise
    self.settle_keys(key)
    # After the round, only what cannot fail on one process alone: the
    # exchange is dispatched, never waited for on this thread (the writer
    # waits for it, at most barrier_timeout_s), and staging waits only for
    # this process's writer to give budget back.
    q: queue.Queue = queue.Queue()
    failed = threading.Event()
    self._fut = self._pool.submit(self._write, step, key, work, manifest, q,
                                  failed, files, own_host, src, t0)
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

  def settle_keys(self, key: str) -> None:
    """The round of the collective call ``key`` passed here, so every
    process has entered that call and is done with the keys of the calls
    before it (each waits for its writer before a round): process 0
    deletes those. ``key``'s own go at the next call's round, so the
    coordination service does not grow with every call."""
    done, self._round_keys = self._round_keys, [key]
    for k in done:
      multihost.forget(k)

  def _prepare(self, step, key, arrays, work, manifest, own_host,
               files) -> dict:
    """Before the round, the part of a save that can fail on this process
    alone: the plan, the step directory and its files (opened into
    ``files``), the host values posted for the partner."""
    lay = self.layout
    if self._broken:
      raise CheckpointError(self._broken)
    plan = self._plan(arrays, manifest)
    try:
      os.makedirs(work)
      for fname in _DATA_FILES.values():
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
    lay = self.layout
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
        idx = _index(s.index, shape)
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
        boxes = [_index(imap[d], shape) for d in src_devs]
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
    lay = self.layout
    for batch in batches:
      nb = sum(it[1] for _, items in batch for it in items)
      held = self.budget.acquire(nb, failed)
      outs = lay.permute([stacked for stacked, _ in batch])
      deadline = time.monotonic() + self.timeout_s
      if not held:
        continue
      boxes = []
      for out, (_, items) in zip(outs, batch):
        got = {s.device: s.data for s in out.addressable_shards}
        for offset, n, j, ss in items:
          boxes.append((offset, n, got[lay.local[j]], ss))
      q.put(("wait", 0, ([b[2] for b in boxes], deadline, self.timeout_s,
                         f"the partner exchange of local step {step}"), 0))
      for offset, n, data, ss in boxes:
        q.put(("partner.bin", offset, (data, ss), n))

  def _write(self, step, key, work, manifest, q, failed, files, own_host,
             src, t0) -> None:
    """The background part: write what the caller stages, fsync, agree,
    commit (rename), clean up leftovers and apply retention."""
    error: BaseException | None = None
    lost = None  # the exchange did not complete in time: no barrier
    crcs: dict[tuple[str, int], int] = {}  # (file, offset): crc32c
    drained = False
    try:
      self._remove_leftovers(keep=os.path.basename(work))
      self._remove_unusable()
      while True:
        item = q.get()
        if item is None:
          drained = True
          break
        kind, offset, data, nb = item
        if kind == "error":
          error = error or data
          continue
        if kind == "wait":  # also after a failure: was it abandoned?
          try:
            _wait_ready(*data)
          except BarrierTimeoutError as e:
            lost = e
            error = error or e
            failed.set()
          continue
        try:
          if error is None:
            if kind == "partner.bin":  # ready: a view on CPU, no copy
              data = np.asarray(data[0]).reshape(data[1])
            f = files[kind]
            f.seek(offset)
            # A byte view: memoryview rejects ml_dtypes (bfloat16 ...).
            mv = memoryview(
                np.ascontiguousarray(data).reshape(-1).view(np.uint8))
            crcs[(kind, offset)] = crc32c.crc32c(mv)  # of the staged bytes
            f.write(mv)
        except BaseException as e:  # pylint: disable=broad-except
          error, _ = e, failed.set()
        finally:
          item = data = None  # nothing of it held past its budget
          self.budget.release(nb)
      if error is None:
        partner_host = b""
        if self.layout.n > 1:  # posted before the round: no wait
          partner_host = multihost._wait_for_key(  # pylint: disable=protected-access
              multihost._client().blocking_key_value_get_bytes,  # pylint: disable=protected-access
              f"{key}/host/{src}", self.timeout_s,
              f"the host values of process {src} for the local tier")
        for f in files.values():
          f.flush()
          os.fsync(f.fileno())
        host = msgpack.packb(
            {"own": own_host, "partner": partner_host, "partner_src": src},
            use_bin_type=True)
        storage_lib.write_file(os.path.join(work, "host.msgpack"), host)
        manifest["files"] = {"host.msgpack": len(host)}
        manifest["crc32c"] = {"host.msgpack": crc32c.crc32c(host)}
        for part, fname in _DATA_FILES.items():
          size = 0
          for e in manifest[part].values():
            for sh in e["shards"]:
              sh.append(crcs[(fname, sh[1])])
              size = max(size, sh[1] + sh[2])
          manifest["files"][fname] = size
        storage_lib.write_file(os.path.join(work, "manifest.json"),
                    json.dumps(manifest).encode())
        commit_lib.fsync_dir(work)
    except BaseException as e:  # pylint: disable=broad-except
      error = error or e
    finally:
      for f in files.values():
        f.close()
      if error is not None:
        failed.set()  # the caller stages nothing more
      while not drained:  # whatever it staged before it heard, given back
        item = q.get()
        drained = item is None
        if not drained:
          self.budget.release(item[3])
    if lost is not None:
      # A process did not join the exchange within barrier_timeout_s: the
      # others are not waited for again at the barrier (that would double
      # the bound); none commits, as this process never arrives there. Its
      # device collectives may now be out of step with the others': it
      # saves no more local steps in this job.
      self._broken = (
          f"process {self.layout.pid} abandoned the partner exchange of "
          f"local step {step} after barrier_timeout_s = {self.timeout_s:g} s "
          "(a process did not join it); its device collectives may be out "
          "of step with the other processes', so the local tier saves no "
          "more steps in this job: restart it")
      shutil.rmtree(work, ignore_errors=True)
      multihost.report_failure(f"{key}/failed", f"{type(error).__name__}: {error}")
      raise error
    if error is not None:
      multihost.report_failure(f"{key}/failed", f"{type(error).__name__}: {error}")
    multihost.barrier(f"{key}/written", timeout_s=self.timeout_s,
                      what=f"the local tier's save of step {step}")
    failures = multihost.reported_failures(f"{key}/failed")
    if error is not None or failures:
      shutil.rmtree(work, ignore_errors=True)
      if error is not None:
        raise error
      raise CheckpointError(f"local save of step {step} failed on process(es) "
                            f"{sorted(failures)}: {failures}")
    final = os.path.join(self.dir, f"step_{step}")
    if os.path.exists(final):  # saved again: the old one goes first
      _remove(final, self.dir, step)
    os.rename(work, final)
    commit_lib.fsync_dir(self.dir)
    self.last_save_stats["total_s"] = time.perf_counter() - t0
    self._retain()

  def _retain(self) -> None:
    """Keeps the ``keep`` newest steps up to the step saved last, never
    that step, whatever its number.

    The step saved last is set by MultiTierCheckpointer.save
    (``_newest_saved``), which refused the save if the job could rebuild
    any local step above it: steps above it here are parts of steps no
    restore can use (a host and its partner lost), and go too. Without it
    (the class alone): the highest steps are kept."""
    steps = self.committed_steps()
    head = getattr(self, "_newest_saved", None)
    above = []
    if head in steps:
      above = [s for s in steps if s > head]
      steps = [s for s in steps if s <= head]
    for s in above + steps[:-self.keep]:
      try:
        _remove(os.path.join(self.dir, f"step_{s}"), self.dir, s)
      except OSError as e:
        logging.warning("ckpt: local tier could not delete step %d: %s", s, e)

  # -- delete (MultiTierCheckpointer.delete) --

  def hide_step(self, step: int) -> str | None:
    """This process's ``step_<step>`` renamed away (atomic): the path it
    now has, or None if this process holds no such step. Raises OSError
    if the rename fails (the step is then unchanged). ``unhide_step``
    puts it back, ``drop_hidden`` removes it; a hidden step left by a
    crash is removed at the next save (as any ``.del-`` directory)."""
    path = os.path.join(self.dir, f"step_{step}")
    if not os.path.isdir(path):
      return None
    gone = os.path.join(self.dir,
                        f"step_{step}.del-{multihost.unique_token()}")
    os.rename(path, gone)
    try:
      commit_lib.fsync_dir(self.dir)
    except OSError as e:  # renamed: the step is hidden all the same
      logging.warning("ckpt: local tier could not fsync %s: %s", self.dir, e)
    return gone

  def unhide_step(self, step: int, hidden: str) -> None:
    os.rename(hidden, os.path.join(self.dir, f"step_{step}"))

  @staticmethod
  def drop_hidden(hidden: str) -> None:
    shutil.rmtree(hidden, ignore_errors=True)

  def _remove_leftovers(self, keep: str) -> None:
    for name in os.listdir(self.dir):
      if _TMP_RE.match(name) and name != keep:
        logging.info("ckpt: local tier removes leftover %s",
                     os.path.join(self.dir, name))
        shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

  # -- restore --

  def usable(self, target_leaves, verify=lambda step: True) -> dict:
    """What this process can serve: local steps whose manifest is valid and
    of this run (persistent root, process count, devices), whose own part /
    partner replica match the target's shardings and, for the steps
    ``verify(step)`` names, whose files have the recorded sizes and crc32c.
    Local only (no collective): the caller posts the result in a round."""
    lay = self.layout
    out = {"own": [], "partner": [], "why": ""}
    whys = []

    def skip(why):
      logging.info("ckpt: local tier on process %d: %s", lay.pid, why)
      whys.append(why)

    tsig, unsharded = None, set()
    if target_leaves is not None:
      tsig = {}
      for name, t in target_leaves:
        sig = _target_sig(t)
        if sig is not None:
          tsig[name] = sig
        elif getattr(t, "sharding", None) is None:
          unsharded.add(name)
    for s in reversed(self.committed_steps()):
      try:
        m = self._manifest(s)
      except CorruptCheckpointError as e:
        skip(f"{e}; step skipped")
        continue
      why = self._foreign(m)
      if why:
        skip(f"local step {s} is not restored: {why}")
        continue
      host_bad = None
      for part, proc in (("own", lay.pid), ("partner", m["partner_src"])):
        if part == "partner" and lay.n == 1:
          continue
        if part == "partner" and proc != lay.src[lay.pid]:
          skip(f"local step {s}: this process holds the replica of process "
               f"{proc}, but this job's partner map gives it process "
               f"{lay.src[lay.pid]}'s (the processes' hosts changed since "
               "the save); the replica is not used")
          continue
        # Host values are placed from the host copy, on any sharding.
        hosts = set(m.get("host_names", ()))
        sig = {n: v for n, v in (tsig or {}).items() if n not in hosts}
        why = _mismatch(m[part], sig, lay.devices_of(proc)) if sig else ""
        flat = sorted(n for n in unsharded if n in m[part])
        if flat and not why:
          why = (f"leaves {flat[:4]} have no sharding in the target (the "
                 "local tier places arrays on the target's shardings)")
        if not why and target_leaves is not None:
          known = set(m[part]) | set(m.get("host_names", ()))
          missing = [n for n, _ in target_leaves if n not in known]
          if missing:
            why = f"leaves {missing[:4]} are not in the local tier"
        if why:
          why = f"step {s}: {why}"
        elif verify(s):
          if host_bad is None:
            host_bad = self._verify(s, m, None)
          why = host_bad or self._verify(s, m, part)
          if why:
            which = ("its own part" if part == "own" else
                     f"the replica of process {proc}")
            why = f"{why}; {which} is not used"
        if why:
          skip(why)
        else:
          out[part].append(s)
    out["why"] = "; ".join(whys)[:1000]
    return out

  def restore(self, step: int, target_leaves, need_partner: list[int]):
    """Collective: this process's arrays of ``step`` onto the target's
    shardings (same topology as the save); {name: value}, host_state."""
    key = multihost.call_key(self._key_base, "restore", step)
    t0 = time.perf_counter()
    lay = self.layout
    base = os.path.join(self.dir, f"step_{step}")
    mine = lay.pid not in need_partner
    send_partner = lay.src[lay.pid] in need_partner
    host, own, replica, error, plans = {}, None, None, None, {}
    try:  # everything that can fail on this process alone, before the round
      m = self._manifest(step) if (mine or send_partner) else None
      if m is not None:
        with open(os.path.join(base, "host.msgpack"), "rb") as f:
          host = msgpack.unpackb(f.read(), raw=False)
      # What a Checkpointer refuses for this target (dtype, shape, keys, a
      # sharding that cannot hold the leaf), from the saved leaves this
      # process holds (its own, its partner's), before the round.
      _check_shardings(target_leaves)  # on every process
      for part, run in (("own", mine), ("partner", send_partner)):
        if run:
          plans[part] = _restore_plan(
              msgpack.unpackb(host[part], raw=False), target_leaves,
              self.restore_dtype, f"local step {step} ({part})")
      if mine:
        own = self._read_part(base, m["own"], "own.bin")
      if send_partner:
        replica = self._read_part(base, m["partner"], "partner.bin")
    except Exception as e:  # pylint: disable=broad-except
      error = e
    # A process that cannot read what it checked before the choice (the
    # files changed since) makes every process raise, before the exchange.
    _all_ok(f"{key}/read", error, f"local restore of step {step}",
            self.timeout_s)
    self.settle_keys(key)
    if need_partner:
      if lay.src[lay.pid] in need_partner:
        multihost.post_bytes(f"{key}/host", host["partner"])
      if not mine:
        host_bytes = multihost._wait_for_key(  # pylint: disable=protected-access
            multihost._client().blocking_key_value_get_bytes,  # pylint: disable=protected-access
            f"{key}/host/{lay.dst[lay.pid]}", self.timeout_s,
            "this process's host values from its partner")
    own_host = host["own"] if mine else host_bytes
    values = msgpack.unpackb(own_host, raw=False)
    # Checked before the round, by this process or, on these same bytes, by
    # the partner that sent them: the same plan on every process.
    plan = plans["own"] if mine else _restore_plan(
        values, target_leaves, self.restore_dtype, f"local step {step}")
    out = {}
    arrays = [(n, t) for n, t in target_leaves if plan[n].kind == "array"]
    batch, batch_bytes, read = [], 0, 0

    def flush():
      if not batch:
        return
      stacked = []
      for name, _ in batch:  # exchanged as stored, cast as received
        p = plan[name]
        blocks = []
        for j, d in enumerate(lay.local):
          data = (replica[name]["slot"](j).astype(p.stored, copy=False)
                  if send_partner else np.zeros(p.block, p.stored))
          blocks.append(jax.device_put(data[None], d))
        stacked.append(lay.stack(blocks, p.block, p.stored))
      outs = lay.permute(stacked, inverse=True)
      # Bounded as the save's exchange: a peer that passed the round and
      # then never joins holds no one past barrier_timeout_s.
      _wait_ready(outs, time.monotonic() + self.timeout_s, self.timeout_s,
                  f"the partner exchange of local restore step {step}")
      for (name, _), o in zip(batch, outs):
        if not mine:
          got = {s.device: s.data for s in o.addressable_shards}
          out[name] = _place(plan[name], [got[d][0] for d in lay.local],
                             lay.local)
      batch.clear()

    for name, t in arrays:
      p = plan[name]
      if need_partner:
        nb = int(np.prod(p.block)) * p.stored.itemsize * lay.L
        if batch and batch_bytes + nb > self.budget.budget:
          flush()
          batch_bytes = 0
        batch.append((name, t))
        batch_bytes += nb
      if mine:
        imap = p.sharding.devices_indices_map(p.logical)
        out[name] = _place(p, [own[name]["index"](p.box(imap[d]))
                               for d in lay.local], lay.local)
        read += own[name]["bytes"]
    flush()
    for name, _ in target_leaves:  # host values: local, after the exchange
      if plan[name].kind != "array":
        out[name] = _host_value(plan[name])
    self.last_restore_stats = {"step": step, "from_partner": not mine,
                               "total_s": time.perf_counter() - t0}
    return out, values.get("host_state")

  def _read_part(self, base: str, part: dict, fname: str) -> dict:
    """{leaf: accessors} over one part's data file (memory-mapped)."""
    path = os.path.join(base, fname)
    mm = (np.memmap(path, dtype=np.uint8, mode="r")
          if os.path.exists(path) and os.path.getsize(path) else None)
    out = {}
    for name, e in part.items():
      dt = np.dtype(e["dtype"])

      def shard(k, e=e, dt=dt):
        _, off, nb, shape = e["shards"][k][:4]
        return np.array(mm[off:off + nb]).view(dt).reshape(shape)

      by_index = {tuple(tuple(x) for x in sh[0]): k
                  for k, sh in enumerate(e["shards"])}
      out[name] = {
          "dtype": e["dtype"],
          "bytes": sum(sh[2] for sh in e["shards"]),
          "slot": lambda j, e=e, shard=shard: shard(e["slots"][j]),
          "index": lambda idx, shard=shard, by_index=by_index: shard(
              by_index[tuple(tuple(x) for x in idx)]),
      }
    return out


def _is_int(v, lo: int = 0, hi: int = 1 << 62) -> bool:
  return type(v) is int and lo <= v < hi


def check_manifest(m: Any, step: int, pid: int, path: str) -> None:
  """Raises CorruptCheckpointError unless ``m`` is a manifest of this
  version for ``step`` of process ``pid`` whose shards all lie within the
  data files it records (no field is trusted before this)."""
  def bad(where: str, want: str, got: Any) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"local step {step}: {path} is not a manifest of the local tier: "
        f"{where}: expected {want}, found {str(got)[:200]!r}")

  if not isinstance(m, dict):
    raise bad("the top level", "an object", type(m).__name__)
  for k, want in (("format", FORMAT), ("version", VERSION), ("step", step),
                  ("process", pid)):
    if k not in m:
      raise bad(k, repr(want), "nothing (missing)")
    if m[k] != want or type(m[k]) is not type(want):
      raise bad(k, repr(want), m[k])
  for k, lo in (("process_count", 1), ("local_devices", 1), ("partner_src", 0)):
    if not _is_int(m.get(k), lo, 1 << 20):
      raise bad(k, f"an int >= {lo}", m.get(k, "nothing (missing)"))
  if m["partner_src"] >= m["process_count"]:
    raise bad("partner_src", f"< process_count {m['process_count']}",
              m["partner_src"])
  if not isinstance(m.get("owner"), str):
    raise bad("owner", "the persistent tier's URL", m.get("owner"))
  if not (isinstance(m.get("host_names"), list) and
          all(isinstance(n, str) for n in m["host_names"])):
    raise bad("host_names", "a list of leaf names", m.get("host_names"))
  files = m.get("files")
  names = {"host.msgpack", *_DATA_FILES.values()}
  if (not isinstance(files, dict) or set(files) != names or
      not all(_is_int(v) for v in files.values())):
    raise bad("files", f"the sizes of {sorted(names)}", files)
  crcs = m.get("crc32c")
  if not (isinstance(crcs, dict) and _is_int(crcs.get("host.msgpack"), 0,
                                               1 << 32)):
    raise bad("crc32c", "the crc32c of host.msgpack", crcs)
  for part, fname in _DATA_FILES.items():
    entries = m.get(part)
    if not isinstance(entries, dict):
      raise bad(part, "an object of leaves", entries)
    for name, e in entries.items():
      where = f"{part} leaf {name}"
      if not isinstance(e, dict):
        raise bad(where, "an object", e)
      shape = e.get("shape")
      if not (isinstance(shape, list) and len(shape) <= 64 and
              all(_is_int(d) for d in shape)):
        raise bad(f"{where} shape", "a list of sizes", shape)
      try:
        dt = np.dtype(e.get("dtype"))
      except (TypeError, ValueError):
        dt = None
      if dt is None or dt.hasobject or dt.itemsize == 0:
        raise bad(f"{where} dtype", "a numeric dtype", e.get("dtype"))
      shards, slots = e.get("shards"), e.get("slots")
      if not isinstance(shards, list):
        raise bad(f"{where} shards", "a list", shards)
      if not (isinstance(slots, list) and len(slots) == m["local_devices"] and
              all(_is_int(j, 0, len(shards)) for j in slots)):
        raise bad(f"{where} slots", f"{m['local_devices']} shard numbers",
                  slots)
      for k, sh in enumerate(shards):
        ok = (isinstance(sh, list) and len(sh) == 5 and
              isinstance(sh[0], list) and len(sh[0]) == len(shape) and
              all(isinstance(b, list) and len(b) == 2 and _is_int(b[0]) and
                  _is_int(b[1]) and b[0] <= b[1] <= d
                  for b, d in zip(sh[0], shape)) and
              _is_int(sh[1]) and _is_int(sh[2]) and
              sh[3] == [b[1] - b[0] for b in sh[0]] and
              sh[2] == int(np.prod(sh[3], dtype=np.int64)) * dt.itemsize and
              sh[1] + sh[2] <= files[fname] and _is_int(sh[4], 0, 1 << 32))
        if not ok:
          raise bad(f"{where} shard {k}", "[index, offset, bytes, shape, "
                    f"crc32c] within {fname} ({files[fname]} bytes)", sh)


def _mismatch(entries: dict, tsig: dict, devices) -> str:
  for name, (shape, imap) in tsig.items():
    e = entries.get(name)
    if e is None:
      return f"leaf {name} is not in the local tier"
    if list(e["shape"]) != shape:
      continue  # the restore refuses it as a Checkpointer does
    for j, d in enumerate(devices):
      if d not in imap:
        return f"leaf {name} is not on every device in the target ({d})"
      want = _index(imap[d], shape)
      have = tuple(tuple(x) for x in e["shards"][e["slots"][j]][0])
      if want != have:
        return (f"leaf {name} is sharded differently from the save (device "
                f"{d.id}: saved {have}, target {want})")
  return ""


# ---- restore: what a Checkpointer does with each target leaf -------------------

@functools.lru_cache(maxsize=64)
def _key_dims(dtype) -> tuple[int, ...]:
  """The trailing key-data dimensions of a typed PRNG key dtype."""
  return tuple(jax.eval_shape(jax.random.key_data,
                              jax.ShapeDtypeStruct((), dtype)).shape)


def _target_sig(t) -> tuple | None:
  """(stored shape, {device: stored index}) of a target leaf with a
  sharding (a key target: its key data's, with the key dimensions whole);
  None with no sharding, or one that cannot hold the shape (the restore
  then raises for it as a Checkpointer does: _restore_plan)."""
  sh = getattr(t, "sharding", None)
  if sh is None or not hasattr(t, "shape"):
    return None
  shape = tuple(t.shape)
  tail = _key_dims(t.dtype) if prng.is_key_dtype(t.dtype) else ()
  try:
    imap = sh.devices_indices_map(shape)
  except ValueError:  # uneven: jax's IndivisibleError
    return None
  whole = (slice(None),) * len(tail)
  return (list(shape + tail),
          {d: tuple(idx) + whole for d, idx in imap.items()})


class _Leaf(NamedTuple):
  """How the local tier restores one target leaf (see _restore_plan)."""
  kind: str              # "array" (own.bin / partner.bin), "host", "python"
  sharding: Any          # the target's (None: a numpy value, as saved)
  shape: tuple = ()      # as stored (keys: their key data's shape)
  logical: tuple = ()    # as restored (keys: without the key dimensions)
  stored: Any = None     # the stored dtype
  out: Any = None        # the restored dtype (key data: the stored one)
  impl: str | None = None  # a typed PRNG key leaf's implementation
  value: Any = None      # "host" / "python": the saved value

  @property
  def block(self) -> tuple:
    """One device's block as stored (the partner exchange's unit)."""
    tail = self.shape[len(self.logical):]
    return tuple(self.sharding.shard_shape(self.logical)) + tail

  def box(self, index) -> tuple:
    """The stored box of a device's index into the restored shape."""
    whole = (slice(None),) * (len(self.shape) - len(self.logical))
    return _index(tuple(index) + whole, self.shape)


def _check_shardings(target_leaves) -> None:
  """A target sharding that cannot hold its leaf's shape (uneven: a
  dimension the mesh axis does not divide) raises what a Checkpointer
  restore raises (TreeMismatchError naming the leaf). From the target
  alone, so every process raises the same (the first such leaf)."""
  for name, t in target_leaves:
    sh = getattr(t, "sharding", None)
    if sh is not None and hasattr(t, "shape"):
      restore_lib._check_divides(name, tuple(t.shape), sh)  # pylint: disable=protected-access


def _restore_plan(blob: Any, target_leaves, restore_dtype, where: str
                  ) -> dict[str, _Leaf]:
  """What a ``Checkpointer`` restore does with each target leaf, from the
  saved leaves a host.msgpack part records (``values``, ``arrays``,
  ``prng``: _prepare_leaves): ckpt/restore/read.py ``_resolve``'s checks, with
  its functions, so the local tier refuses what it refuses with the same
  error (TreeMismatchError naming the leaf: a float32 leaf into an int32
  target, keys of another implementation, another shape), applies
  ``restore_dtype`` to the same (floating) leaves and casts only floating
  dtypes. Local: no I/O, no collective. (Uneven target shardings:
  _check_shardings.)"""
  maps = [blob.get(k) if isinstance(blob, dict) else None
          for k in ("values", "arrays", "prng")]
  if not all(isinstance(x, dict) for x in maps):
    raise CorruptCheckpointError(
        f"{where}: host.msgpack records no saved leaves (values, arrays, "
        "prng): not written by this version of the local tier")
  values, arrays, impls = maps
  on_device = blob.get("device", [])
  if not isinstance(on_device, list):
    raise CorruptCheckpointError(
        f"{where}: expected a list of leaf names under 'device', found "
        f"{str(on_device)[:200]!r}")
  missing = [n for n, _ in target_leaves if n not in values and n not in arrays]
  if missing:
    raise MissingLeavesError(missing, sorted({*values, *arrays}))
  plan = {}
  for name, t in target_leaves:
    shape, wanted, sharding, wants_array = restore_lib._target_spec(t, name)  # pylint: disable=protected-access
    impl = impls.get(name) or None
    if impl is not None and not isinstance(impl, str):
      raise CorruptCheckpointError(
          f"{where}: leaf {name!r}: expected a PRNG implementation's name, "
          f"found {impl!r}")
    if name in values:
      value = index_lib.decode_value(values[name], f"{where}: leaf {name!r}")
      if not isinstance(value, (np.ndarray, np.generic)):
        plan[name] = _Leaf("python", None, value=value)  # as saved
        continue
      src = lazy.LazyValue(value, name, prng_impl=impl)
    else:
      a = arrays[name]
      try:
        dtype, stored_shape = np.dtype(a[0]), tuple(int(d) for d in a[1])
        if dtype.hasobject or any(d < 0 for d in stored_shape):
          raise ValueError(a)
      except (TypeError, ValueError, IndexError) as e:
        raise CorruptCheckpointError(
            f"{where}: leaf {name!r}: expected [dtype, shape], found "
            f"{str(a)[:200]!r}") from e
      # Shape and dtype only (a view of one element): what the checks read.
      src = lazy.LazyValue(np.broadcast_to(np.zeros((), dtype), stored_shape),
                           name, prng_impl=impl)
    out = restore_lib.out_dtype(name, src, shape, wanted, wants_array,
                                restore_dtype)
    logical = lazy.logical_shape(src)
    if sharding is None and name in arrays:  # usable() sends these elsewhere
      raise CheckpointError(
          f"{where}: leaf {name!r} has no sharding in the target; the local "
          "tier places arrays on the target's shardings")
    if (sharding is None and name in values and
        isinstance(t, (jax.ShapeDtypeStruct, jax.Array))):
      sharding = _as_saved(name in on_device)
    plan[name] = _Leaf("array" if name in arrays else "host", sharding,
                       tuple(src.shape), tuple(logical), np.dtype(src.dtype),
                       np.dtype(out), impl, None if name in arrays else value)
  return plan


def _as_saved(one_device: bool) -> jax.sharding.Sharding:
  """Where a host value goes for a jax target without a sharding, as the
  persistent tier restores it as saved (ckpt/restore/read.py ``AsSaved``): a
  one-device jax array on this process's first device, a numpy value
  replicated over every device (on a 1-D mesh: the local tier does not
  record the checkpoint's mesh, the persistent tier uses it when there is
  one)."""
  saved = (saved_sharding_lib.SavedSharding("device") if one_device else
           saved_sharding_lib.REPLICATED_HOST)
  return saved.to_sharding()


def _wrap(x: jax.Array, p: _Leaf) -> jax.Array:
  return prng.wrap(x, p.impl) if p.impl else x


def _assemble(p: _Leaf, bufs) -> jax.Array:
  return jax.make_array_from_single_device_arrays(
      p.logical, p.sharding, bufs,
      dtype=prng.info(p.impl).dtype if p.impl else p.out)


def _place(p: _Leaf, datas, devices) -> jax.Array:
  """An array leaf from each local device's block as stored (numpy, or a
  jax.Array on that device): cast with numpy as a Checkpointer casts,
  typed keys wrapped around their data (no copy)."""
  bufs = []
  for x, d in zip(datas, devices):
    if np.dtype(x.dtype) != p.out:
      x = np.asarray(x).astype(p.out)
    if not isinstance(x, jax.Array):
      x = jax.device_put(x, d)
    bufs.append(_wrap(x, p))
  return _assemble(p, bufs)


def _host_value(p: _Leaf) -> Any:
  """A host value restored as a Checkpointer restores an inline value
  (ckpt/restore/assemble.py ``materialize``): numpy (or typed keys on jax's default
  device) with no target sharding, else placed on the target's sharding."""
  if p.kind == "python":
    return p.value
  data = np.asarray(p.value).astype(p.out, copy=False)
  if p.sharding is None:
    if p.impl:
      return prng.wrap(data, p.impl)
    return data[()] if isinstance(p.value, np.generic) else data
  whole = (slice(None),) * (len(p.shape) - len(p.logical))
  imap = p.sharding.addressable_devices_indices_map(p.logical)
  bufs = [_wrap(jax.device_put(np.array(data[tuple(idx) + whole], order="C"),
                               d), p) for d, idx in imap.items()]
  return _assemble(p, bufs)


def _all_ok(key: str, error: BaseException | None, what: str,
            timeout_s: float) -> None:
  """``multihost.all_ok``, except that when every process that failed
  refused the target as a Checkpointer refuses it (a TreeMismatchError:
  the same check of the same saved leaves, so the same message), every
  process raises a TreeMismatchError with that message: a process that
  restores from its partner holds no saved leaves to check before the
  round, and ends as the others do."""
  post = None if error is None else [
      type(error).__name__, str(error)[:4000],
      isinstance(error, TreeMismatchError)]

  def decide(posts: dict[int, str]) -> str:
    got = {p: json.loads(v) for p, v in sorted(posts.items())}
    return json.dumps({p: g for p, g in got.items() if g})

  failed = json.loads(multihost.agree(key, json.dumps(post), decide,
                                      timeout_s=timeout_s, what=what))
  if error is not None:
    raise error
  if not failed:
    return
  refusals = {g[1] for g in failed.values() if g[2]}
  if len(refusals) == 1 and all(g[2] for g in failed.values()):
    raise TreeMismatchError(refusals.pop())
  raise CheckpointError(
      f"{what} failed on process(es) {sorted(int(p) for p in failed)}: "
      + "; ".join(f"process {p}: {g[0]}: {g[1]}" for p, g in failed.items()))


def _remove(path: str, parent: str, step: int) -> None:
  """Renames a committed step away first, so it is never half-deleted."""
  gone = os.path.join(parent, f"step_{step}.del-{multihost.unique_token()}")
  os.rename(path, gone)
  shutil.rmtree(gone, ignore_errors=True)
