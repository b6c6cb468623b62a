"""Typed PRNG keys (``jax.random.key``) as checkpoint leaves.

numpy has no key dtype, so a key array is stored as its key data
(``jax.random.key_data``: uint32, with the implementation's trailing
dimensions, e.g. ``(8, 2)`` for 8 threefry keys) plus the implementation's
name, recorded in the index entry as ``prng_impl``. Restore wraps the data
back (``jax.random.wrap_key_data``) into keys of that implementation. Lazy
leaves of a key hold its key data (that shape and dtype) and name the
implementation in ``LazyLeaf.prng_impl``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import numpy as np

MAX_NAME_CHARS = 128


class KeyInfo(NamedTuple):
  """What jax says about one PRNG implementation."""
  dtype: Any                   # the key dtype, e.g. key<fry>
  key_shape: tuple[int, ...]   # trailing key-data dimensions, e.g. (2,)
  data_dtype: np.dtype         # the key data's dtype (uint32)


def is_key_dtype(dtype: Any) -> bool:
  """True for typed PRNG key dtypes (never raises)."""
  try:
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
  except TypeError:
    return False


def is_extended_dtype(dtype: Any) -> bool:
  """True for jax dtypes numpy cannot represent (keys and others)."""
  try:
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))
  except TypeError:
    return False


@functools.lru_cache(maxsize=64)
def _info(name: str) -> KeyInfo | None:
  try:  # shapes only: nothing runs on a device
    keys = jax.eval_shape(functools.partial(jax.random.key, 0, impl=name))
    data = jax.eval_shape(jax.random.key_data, keys)
  except (ValueError, TypeError, KeyError):
    return None
  return KeyInfo(keys.dtype, tuple(data.shape), np.dtype(data.dtype))


def info(name: Any) -> KeyInfo | None:
  """The implementation registered with jax under ``name``, or None."""
  if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
    return None
  return _info(name)


def impl_name(x: jax.Array) -> str:
  """The name of the implementation of key array ``x``, e.g. "rbg"."""
  spec = jax.random.key_impl(x)
  return spec if isinstance(spec, str) else str(getattr(spec, "name", spec))


def wrap(data, name: str) -> jax.Array:
  """Key data (numpy or a jax.Array on one device) as typed keys."""
  return jax.random.wrap_key_data(data, impl=name)


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: Any) -> str:
  names: list[str] = []
  jax.eval_shape(lambda k: names.append(impl_name(k)),
                 jax.ShapeDtypeStruct((), dtype))
  return names[0]


def describe(dtype: Any) -> str:
  """A key dtype for messages: "rbg keys (key<rbg>)"; other dtypes as is."""
  if not is_key_dtype(dtype):
    return str(dtype)
  try:
    return f"{_dtype_name(dtype)} keys ({dtype})"
  except Exception:  # pylint: disable=broad-except  (only a message)
    return f"PRNG keys ({dtype})"
