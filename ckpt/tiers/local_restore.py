"""The restore path of the local tier (ckpt/tiers/local_tier.py):
``LocalRestorer.usable`` says which local steps this process can serve for a
target (posted in MultiTierCheckpointer's round), ``restore`` reads this
process's part of the chosen step, or gets it back from its partner with the
inverse ``ppermute``, onto the target's shardings; ``_all_ok`` ends every
process alike when one refuses the target.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack
import numpy as np
from absl import logging

import jax

from ckpt.multihost import posts as posts_lib
from ckpt.multihost import process as multihost
from ckpt.tiers.local_exchange import Budget, TierRounds, wait_ready
from ckpt.tiers.local_leaves import (check_shardings, host_value, place,
                                     restore_plan, target_sig)
from ckpt.tiers.local_manifest import covered, mismatch
from ckpt.tiers.local_steps import LocalSteps
from ckpt.errors import (CheckpointError, CorruptCheckpointError,
                         TreeMismatchError)


class LocalRestorer:
  """LocalTier's restore: what this process can serve, and the restore."""

  def __init__(self, steps: LocalSteps, rounds: TierRounds, budget: Budget,
               restore_dtype: Any):
    self._steps = steps
    self._rounds = rounds
    self.budget = budget
    # As the persistent tier's (Checkpointer restore_dtype): floating
    # leaves cast after they are read.
    self.restore_dtype = restore_dtype
    self.last_restore_stats: dict = {}

  def usable(self, target_leaves, verify=lambda step: True) -> dict:
    """What this process can serve: local steps whose manifest is valid and
    of this run (persistent root, process count, devices), whose own part /
    partner replica match the target's shardings and, for the steps
    ``verify(step)`` names, whose files have the recorded sizes and crc32c.
    Local only (no collective): the caller posts the result in a round."""
    lay = self._rounds.layout
    out = {"own": [], "partner": [], "why": ""}
    whys = []

    def skip(why):  # one line per step: the restore says it once
      logging.vlog(1, "ckpt: local tier on process %d: %s", lay.pid, why)
      whys.append(why)

    tsig, unsharded = None, set()
    if target_leaves is not None:
      tsig = {}
      for name, t in target_leaves:
        sig = target_sig(t)
        if sig is not None:
          tsig[name] = sig
        elif getattr(t, "sharding", None) is None:
          unsharded.add(name)
    steps = self._steps
    for s in reversed(steps.committed_steps()):
      try:
        m = steps.manifest(s)
      except CorruptCheckpointError as e:
        skip(f"{e}; step skipped")
        continue
      why = steps.foreign(m)
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
        why = mismatch(m[part], sig, lay.devices_of(proc)) if sig else ""
        if (why and part == "own" and "sharded differently" in why and
            covered(m[part], sig, lay.devices_of(proc))):
          why = ""  # every byte is here: restored from its own shards
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
          which = "" if part == "own" else f" (the replica of process {proc})"
          why = f"step {s}{which}: {why}"
        elif verify(s):
          if host_bad is None:
            host_bad = steps.verify(s, m, None)
          why = host_bad or steps.verify(s, m, part)
          if why:
            which = ("its own part" if part == "own" else
                     f"the replica of process {proc}")
            why = f"{why}; {which} is not used"
        if why:
          skip(why)
        else:
          out[part].append(s)
    # The first reason (the newest step's), and how many more there are.
    out["why"] = (whys[0][:800] + (f" (and {len(whys) - 1} more)"
                                   if len(whys) > 1 else "")) if whys else ""
    return out

  def restore(self, step: int, target_leaves, need_partner: list[int]):
    """Collective: this process's arrays of ``step`` onto the target's
    shardings (same topology as the save); {name: value}, host_state."""
    key = self._rounds.call_key("restore", step)
    t0 = time.perf_counter()
    lay = self._rounds.layout
    base = os.path.join(self._steps.dir, f"step_{step}")
    mine = lay.pid not in need_partner
    send_partner = lay.src[lay.pid] in need_partner
    host, own, replica, error, plans = {}, None, None, None, {}
    try:  # everything that can fail on this process alone, before the round
      m = self._steps.manifest(step) if (mine or send_partner) else None
      if m is not None:
        with open(os.path.join(base, "host.msgpack"), "rb") as f:
          host = msgpack.unpackb(f.read(), raw=False)
      # What a Checkpointer refuses for this target (dtype, shape, keys, a
      # sharding that cannot hold the leaf), from the saved leaves this
      # process holds (its own, its partner's), before the round.
      check_shardings(target_leaves)  # on every process
      for part, run in (("own", mine), ("partner", send_partner)):
        if run:
          plans[part] = restore_plan(
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
            self._rounds.timeout_s)
    self._rounds.settle_keys(key)
    if need_partner:
      if lay.src[lay.pid] in need_partner:
        multihost.post_bytes(f"{key}/host", host["partner"])
      if not mine:
        host_bytes = multihost.read_post(
            f"{key}/host", lay.dst[lay.pid], self._rounds.timeout_s,
            "this process's host values from its partner")
    own_host = host["own"] if mine else host_bytes
    values = msgpack.unpackb(own_host, raw=False)
    # Checked before the round, by this process or, on these same bytes, by
    # the partner that sent them: the same plan on every process.
    plan = plans["own"] if mine else restore_plan(
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
      timeout_s = self._rounds.timeout_s
      wait_ready(outs, time.monotonic() + timeout_s, timeout_s,
                  f"the partner exchange of local restore step {step}")
      for (name, _), o in zip(batch, outs):
        if not mine:
          got = {s.device: s.data for s in o.addressable_shards}
          out[name] = place(plan[name], [got[d][0] for d in lay.local],
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
        if not mine:  # what this process receives from its partner
          read += nb
      if mine:
        imap = p.sharding.devices_indices_map(p.logical)
        out[name] = place(p, [own[name]["box"](p.box(imap[d]))
                               for d in lay.local], lay.local)
        read += own[name]["bytes"]
    flush()
    for name, _ in target_leaves:  # host values: local, after the exchange
      if plan[name].kind != "array":
        out[name] = host_value(plan[name])
    self.last_restore_stats = {"step": step, "from_partner": not mine,
                               "bytes_read": read,
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

      def box(want, e=e, dt=dt, shard=shard, by_index=by_index):
        """The stored box ``want``: a saved shard, or (other target
        shardings, usable() checked that every byte is here) assembled
        from the saved shards it intersects."""
        want = tuple(tuple(x) for x in want)
        if want in by_index:
          return shard(by_index[want])
        out = np.empty([b - a for a, b in want], dt)
        for k, sh in enumerate(e["shards"]):
          lo = [max(a, h[0]) for (a, _), h in zip(want, sh[0])]
          hi = [min(b, h[1]) for (_, b), h in zip(want, sh[0])]
          if all(l < h for l, h in zip(lo, hi)):
            out[tuple(slice(l - a, h - a) for l, h, (a, _) in
                      zip(lo, hi, want))] = shard(k)[tuple(
                          slice(l - h[0], u - h[0]) for l, u, h in
                          zip(lo, hi, sh[0]))]
        return out

      out[name] = {
          "dtype": e["dtype"],
          "bytes": sum(sh[2] for sh in e["shards"]),
          "slot": lambda j, e=e, shard=shard: shard(e["slots"][j]),
          "box": box,
      }
    return out



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

  def decide(got: dict[int, list | None]) -> dict:
    return {p: g for p, g in got.items() if g}

  failed = posts_lib.agree(key, post, decide, timeout_s=timeout_s,
                           what=what)
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
