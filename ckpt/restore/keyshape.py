"""The shapes of a PRNG key leaf: its stored key data has the key
implementation's trailing dimensions (``key_rank``), which the keys it reads
as do not (``logical_shape``). Shared by the lazy leaves, their assembly
and the restore's checks; imports no lazy leaf type.
"""

from __future__ import annotations

from ckpt.format import prng
from ckpt.errors import TreeMismatchError


def key_rank(leaf) -> int:
  """How many trailing dimensions of a key leaf's data are the key
  implementation's (0 for any other leaf)."""
  if not leaf.prng_impl:
    return 0
  key = prng.info(leaf.prng_impl)
  if key is None:
    raise TreeMismatchError(
        f"leaf {leaf.path!r}: holds PRNG keys of implementation "
        f"{leaf.prng_impl!r}, which this jax does not know")
  return len(key.key_shape)


def logical_shape(leaf) -> tuple[int, ...]:
  """The shape of what ``leaf`` reads as: for a key leaf the key array's
  shape (its data's without the trailing implementation dimensions)."""
  shape = tuple(leaf.shape)
  return shape[:len(shape) - key_rank(leaf)]
