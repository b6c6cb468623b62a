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

Leaves mean what they mean to a ``Checkpointer`` (``prepare_leaves``,
``restore_plan``): the same names, ``save_dtype`` / ``restore_dtype``
casts of floating leaves (with numpy, so both tiers hold the same bits),
typed PRNG keys stored as key data with their implementation, arrays one
process holds whole (an uncommitted ``jnp.asarray(10)``) as host values, and
the same refusals (TreeMismatchError naming the leaf: a float32 leaf into an
int32 target, another shape, keys of another implementation) raised by
every process before the exchange, not a fall back to another step.

``LocalTier`` is composed of: ckpt/tiers/local_steps.py (step directories,
manifests read and verified, retention, delete), local_save.py (the save
path), local_restore.py (what a process can serve, the restore path),
local_manifest.py (the manifest's format and its checks), local_leaves.py
(leaves as a Checkpointer treats them) and local_exchange.py (the byte
budget, the bounded wait for the partner exchange).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
from typing import Any

from ckpt.multihost import process as multihost
from ckpt.tiers import partner
from ckpt.face import loop as loop_lib
from ckpt.tiers.local_exchange import Budget
from ckpt.tiers.local_restore import RestoreMixin
from ckpt.tiers.local_save import SaveMixin
from ckpt.tiers.local_steps import StepsMixin
from ckpt.checkpointer import DEFAULT_CONCURRENT_BYTES


# ---- the local tier ------------------------------------------------------------

class LocalTier(StepsMixin, SaveMixin, RestoreMixin):
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
    self.budget = Budget(concurrent_bytes)
    self.timeout_s = barrier_timeout_s
    # The same on every process (never hash(): it is salted per process).
    self._key_base = "local-" + hashlib.sha1(
        os.fspath(directory).encode()).hexdigest()[:16]
    # The writer of a save runs on this tier's own background loop (the
    # one concurrency model, ckpt/face/loop.py), one save at a time.
    self._loop = loop_lib.BackgroundLoop("LocalTier", name="ckpt-local")
    self._fut: concurrent.futures.Future | None = None
    # The step saved last as the job's newest (retention keeps it, and
    # removes the steps above it: MultiTierCheckpointer.save refused them).
    self._newest_saved: int | None = None
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

  def _start_writer(self, fn, *args) -> None:
    """Runs ``fn(*args)`` (a save's writer) in the background."""
    self._fut = self._loop.submit(asyncio.to_thread(fn, *args))

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

  def call_key(self, name: str) -> str:
    """The coordination key of this tier's next collective call ``name``
    (the same on every process: calls are made in the same order)."""
    return multihost.call_key(self._key_base, name)

  def settle_keys(self, key: str) -> None:
    """The round of the collective call ``key`` passed here, so every
    process has entered that call and is done with the keys of the calls
    before it (each waits for its writer before a round): process 0
    deletes those. ``key``'s own go at the next call's round, so the
    coordination service does not grow with every call."""
    done, self._round_keys = self._round_keys, [key]
    for k in done:
      multihost.forget(k)


def owner_of(spec: dict) -> str:
  """The persistent tier's root, normalised (an absolute path for a local
  one): what ties a local step to the run that saved it."""
  driver, path = spec.get("driver", ""), spec.get("path", "")
  return f"{driver}://{spec.get('bucket', '')}/{path.strip('/')}"
