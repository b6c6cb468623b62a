"""The partner ring of the local tier (ckpt/local_tier.py): which process
keeps a replica of which, and the jitted ``ppermute`` over every device
that sends each process's blocks to its partner and back.
"""

from __future__ import annotations

import numpy as np

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ckpt.errors import CheckpointError


def _process_slices() -> list[int]:
  """Slice index of each process (TPU multi-slice); 0 where unknown."""
  out = [0] * jax.process_count()
  for d in jax.devices():
    out[d.process_index] = int(getattr(d, "slice_index", 0) or 0)
  return out


def partner_of(n: int, slices: list[int]) -> list[int]:
  """``dst[p]``: the process that keeps a replica of process p's shards.

  Another process (= another host) when n >= 2; with several slices of
  equal size, the process at the same position in the next slice, so that
  losing a whole slice loses no step.
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
  return [(p + 1) % n for p in range(n)]


class Layout:
  """The 1-D mesh of every device, ordered by (process, local position), and
  the jitted permutes to and from the partner (cached per perm)."""

  def __init__(self):
    self.n, self.pid = jax.process_count(), jax.process_index()
    self.devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    self.L = jax.local_device_count()
    if len(self.devs) != self.n * self.L:
      raise CheckpointError("the local tier needs the same number of devices "
                            "on every process")
    self.local = self.devs[self.pid * self.L:(self.pid + 1) * self.L]
    self.dst = partner_of(self.n, _process_slices())
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
