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

``LocalTier`` is built from parts that own their state: ``LocalSteps``
(ckpt/tiers/local_steps.py: step directories, manifests read and verified,
retention, delete), ``LocalSaver`` (local_save.py: the save path, its writer
on a background loop), ``LocalRestorer`` (local_restore.py: what a process
can serve, the restore path) and ``TierRounds`` (local_exchange.py: the
partner layout, the keys of the tier's rounds; with the byte budget and the
bounded wait for the partner exchange); local_manifest.py holds the
manifest's format and its checks, local_leaves.py leaves as a Checkpointer
treats them.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import jax

from ckpt.multihost import process as multihost
from ckpt.tiers import partner
from ckpt.tiers.local_exchange import Budget, TierRounds
from ckpt.tiers.local_restore import LocalRestorer
from ckpt.tiers.local_save import LocalSaver
from ckpt.tiers.local_steps import LocalSteps
from ckpt.checkpointer import DEFAULT_CONCURRENT_BYTES


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
    self.root = os.path.abspath(os.fspath(directory))
    self.timeout_s = barrier_timeout_s
    self.budget = Budget(concurrent_bytes)
    # The same key base on every process (never hash(): it is salted per
    # process).
    self.rounds = TierRounds("local-" + hashlib.sha1(
        os.fspath(directory).encode()).hexdigest()[:16], barrier_timeout_s)
    self.steps = LocalSteps(self.root, int(keep), str(owner), self.rounds)
    self.saver = LocalSaver(self.steps, self.rounds, self.budget, save_dtype)
    self.restorer = LocalRestorer(self.steps, self.rounds, self.budget,
                                  restore_dtype)

  # -- what the parts hold --

  @property
  def layout(self) -> partner.Layout:
    return self.rounds.layout

  @property
  def dir(self) -> str:
    return self.steps.dir

  @property
  def last_save_stats(self) -> dict:
    return self.saver.last_save_stats

  @property
  def last_restore_stats(self) -> dict:
    return self.restorer.last_restore_stats

  # -- the calls of MultiTierCheckpointer, handed to the parts --

  def call_key(self, name: str) -> str:
    return self.rounds.call_key(name)

  def settle_keys(self, key: str) -> None:
    self.rounds.settle_keys(key)

  # The tier's device work (the partner exchange over its own mesh, a 0-d
  # block given an axis, a received block indexed) runs with the caller's
  # context mesh set aside (``jax.set_mesh(None)``, this thread only): jax
  # refuses one-device arguments and other meshes under ``jax.set_mesh``.

  def save(self, step: int, state: Any, host_state: Any = None,
           newest: bool = False) -> None:
    with jax.set_mesh(None):
      self.saver.save(step, state, host_state, newest)

  def wait(self) -> None:
    self.saver.wait()

  def running(self) -> bool:
    return self.saver.running()

  def finish_within(self, timeout: float) -> bool:
    return self.saver.finish_within(timeout)

  def close(self) -> None:
    self.saver.close()

  def usable(self, target_leaves, verify=lambda step: True) -> dict:
    return self.restorer.usable(target_leaves, verify)

  def restore(self, step: int, target_leaves, need_partner: list[int]):
    with jax.set_mesh(None):
      return self.restorer.restore(step, target_leaves, need_partner)

  def committed_steps(self) -> list[int]:
    return self.steps.committed_steps()

  def set_aside_above(self, step: int) -> list[int]:
    return self.steps.set_aside_above(step)

  def manifest(self, step: int) -> dict:
    return self.steps.manifest(step)

  def foreign(self, m: dict) -> str:
    return self.steps.foreign(m)

  def hide_step(self, step: int) -> str | None:
    return self.steps.hide_step(step)

  def unhide_step(self, step: int, hidden: str) -> None:
    self.steps.unhide_step(step, hidden)

  def drop_hidden(self, hidden: str) -> None:
    self.steps.drop_hidden(hidden)


def owner_of(spec: dict) -> str:
  """The persistent tier's root, normalised (an absolute path for a local
  one): what ties a local step to the run that saved it."""
  driver, path = spec.get("driver", ""), spec.get("path", "")
  return f"{driver}://{spec.get('bucket', '')}/{path.strip('/')}"
