"""The partner map of the local tier (ckpt/tiers/local_tier.py): which process
keeps a replica of which, and the jitted ``ppermute`` over every device
that sends each process's blocks to its partner and back.

Partners are chosen by failure domain: with several TPU slices of equal
size, the process at the same position in the next slice; otherwise by
host, so that losing one host (all its processes) loses no step while
another host holds its replicas. Each process's host is ``host_id()``,
exchanged once in a key-value round when the layout is built.
"""

from __future__ import annotations

import json
import os
import socket

import numpy as np
from absl import logging

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ckpt.multihost import process as multihost
from ckpt.errors import CheckpointError

# Overrides the host name: set it to the machine's name where processes on
# one machine see different host names (containers, one pod per GPU), or
# processes on different machines the same one.
ENV_HOST_ID = "CKPT_HOST_ID"
_MAX_HOST_ID = 255


def host_id() -> str:
  """What identifies this process's machine: ``$CKPT_HOST_ID`` if set, else
  the host name (``socket.gethostname()``, the UTS node name: no name
  resolution, so it cannot hang on DNS; it is what schedulers and people
  call a host, and a container runtime or a VM gives a different one per
  failure domain it isolates)."""
  return (os.environ.get(ENV_HOST_ID) or socket.gethostname())[:_MAX_HOST_ID]


def _process_slices() -> list[int]:
  """Slice index of each process (TPU multi-slice); 0 where unknown."""
  out = [0] * jax.process_count()
  for d in jax.devices():
    out[d.process_index] = int(getattr(d, "slice_index", 0) or 0)
  return out


def exchange_hosts(key: str, timeout_s: float) -> list[str]:
  """Collective (every process, once): ``host_id()`` of every process, in
  process order. One round (set, barrier, get), a barrier once every
  process has read the answer, and process 0 deletes the keys."""
  n = jax.process_count()
  me = host_id()
  if n == 1 or not multihost.is_multiprocess():
    return [me] * n
  what = "the hosts of the local tier's processes"

  def decide(posts: dict[int, str]) -> str:
    return json.dumps([posts.get(p, "") for p in range(n)])

  hosts = json.loads(multihost.agree(key, me, decide, timeout_s=timeout_s,
                                     what=what))
  multihost.barrier(f"{key}/read", timeout_s=timeout_s, what=what)
  multihost.forget(key)
  return hosts


def _shift(groups: list[list[int]], n: int) -> list[int]:
  """Every process, listed group after group (the largest first), sends to
  the process ``m`` places further on (``m``: the largest group's size).
  A permutation; no process is its own partner (m < n); when no group holds
  more than half of the processes every partner is in another group, else
  the fewest possible (2m - n) stay in the largest one. Groups of equal
  size: the process at the same position in the next group."""
  m = max(len(g) for g in groups)
  order = [p for g in sorted(groups, key=lambda g: (-len(g), g[0])) for p in g]
  dst = [0] * n
  for i, p in enumerate(order):
    dst[p] = order[(i + m) % n]
  return dst


def partner_of(n: int, slices: list[int],
               hosts: list[str] | None = None) -> list[int]:
  """``dst[p]``: the process that keeps a replica of process p's shards.

  A permutation (every process keeps exactly one replica), a function of
  (process index, slice, host) only, the same on every process:

  - one process: itself;
  - several slices of equal size: the process at the same position in the
    next slice, so losing a whole slice loses no step;
  - else, by host (``hosts[p]``; groups ordered by size, then by their
    first process, never by name, so a replaced host with a new name
    keeps the map): every partner on another host when no host has more
    than half the processes, else as many as possible;
  - one host (or ``hosts`` unknown): the ring p -> p + 1.
  """
  if n == 1:
    return [0]
  groups: dict[int, list[int]] = {}
  for p, s in enumerate(slices):
    groups.setdefault(s, []).append(p)
  order = sorted(groups)
  if len(order) > 1 and len({len(g) for g in groups.values()}) == 1:
    dst = [0] * n
    for k, s in enumerate(order):
      nxt = groups[order[(k + 1) % len(order)]]
      for pos, p in enumerate(groups[s]):
        dst[p] = nxt[pos]
    return dst
  if hosts is not None and len(set(hosts)) > 1:
    by_host: dict[str, list[int]] = {}
    for p, h in enumerate(hosts):
      by_host.setdefault(h, []).append(p)
    return _shift(list(by_host.values()), n)
  return [(p + 1) % n for p in range(n)]


def _log_map(dst: list[int], hosts: list[str]) -> None:
  n = len(dst)
  if n == 1:
    return
  if len(set(hosts)) == 1:
    logging.info("ckpt: the local tier's %d processes all report host %r: "
                 "partners form the ring p -> p+1, and losing that host "
                 "loses the local tier (set $%s where the host name does "
                 "not identify the machine)", n, hosts[0], ENV_HOST_ID)
    return
  same = [p for p in range(n) if hosts[p] == hosts[dst[p]]]
  shown = ", ".join(f"{p}->{dst[p]}" for p in range(min(n, 64)))
  logging.info("ckpt: the local tier's partners (process -> the process "
               "keeping its replica) over %d hosts: %s%s", len(set(hosts)),
               shown, " ..." if n > 64 else "")
  if same:
    logging.warning(
        "ckpt: the local tier keeps the replicas of %d process(es) on their "
        "own host (more than half the processes are on one host): %s",
        len(same), ", ".join(f"process {p} -> {dst[p]} on {hosts[p]!r}"
                             for p in same[:32]) + (" ..." if len(same) > 32
                                                     else ""))


class Layout:
  """The 1-D mesh of every device, ordered by (process, local position), and
  the jitted permutes to and from the partner (cached per perm).

  Collective when there are several processes: every process builds it at
  the same call (the hosts are exchanged under ``key_base``, bounded by
  ``timeout_s``)."""

  def __init__(self, key_base: str = "partner",
               timeout_s: float = multihost.DEFAULT_TIMEOUT_S):
    hosts_key = multihost.call_key(key_base, "hosts")  # before any failure
    self.n, self.pid = jax.process_count(), jax.process_index()
    self.devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    self.L = jax.local_device_count()
    if len(self.devs) != self.n * self.L:
      raise CheckpointError("the local tier needs the same number of devices "
                            "on every process")
    self.local = self.devs[self.pid * self.L:(self.pid + 1) * self.L]
    self.hosts = exchange_hosts(hosts_key, timeout_s)
    self.dst = partner_of(self.n, _process_slices(), self.hosts)
    if sorted(self.dst) != list(range(self.n)):  # a bug, never bad input
      raise CheckpointError(f"the local tier's partner map {self.dst} is not "
                            "a permutation")
    if self.pid == 0:
      _log_map(self.dst, self.hosts)
    self.src = [0] * self.n
    for p, q in enumerate(self.dst):
      self.src[q] = p
    self.mesh = Mesh(np.array(self.devs), ("tier",))
    self._fns = {}

  def devices_of(self, p: int):
    return self.devs[p * self.L:(p + 1) * self.L]

  def permute(self, arrays: list, inverse: bool = False) -> list:
    """Each device's block of every ``(n*L, ...)`` array goes to the same
    local position on the partner (``inverse``: back from it)."""
    if not arrays:
      return []
    L = self.L
    pairs = [(p * L + j, self.dst[p] * L + j) for p in range(self.n)
             for j in range(L)]
    if inverse:
      pairs = [(b, a) for a, b in pairs]
    fn = self._fns.get(inverse)
    if fn is None:
      from jax.experimental.shard_map import shard_map  # pylint: disable=g-import-not-at-top
      perm = tuple(pairs)
      fn = jax.jit(shard_map(
          lambda xs: [jax.lax.ppermute(x, "tier", perm) for x in xs],
          mesh=self.mesh, in_specs=P("tier"), out_specs=P("tier")))
      self._fns[inverse] = fn
    return fn(list(arrays))

  def join(self, blocks: list):
    """The ``(n*L*b0, ...)`` array whose block on each of this process's
    devices is that device's ``(b0, ...)`` array itself (no copy; b0 >= 1):
    what ``permute`` sends with no stacking copy."""
    sh = NamedSharding(self.mesh, P("tier"))
    b = blocks[0].shape
    return jax.make_array_from_single_device_arrays(
        (self.n * self.L * b[0], *b[1:]), sh, blocks)

  def stack(self, blocks: list, block_shape, dtype):
    """A ``(n*L, *block_shape)`` array from this process's L device blocks."""
    sh = NamedSharding(self.mesh, P("tier"))
    return jax.make_array_from_single_device_arrays(
        (self.n * self.L, *block_shape), sh, blocks)
