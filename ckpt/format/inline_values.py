"""Inline values of an index: the small leaves (python scalars, strings,
numpy scalars and tiny arrays) kept in the index itself rather than stored
as arrays, encoded to msgpack-able maps (``encode_value``) and decoded and
validated back (``decode_value``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ckpt.format import tree
from ckpt.format.checks import (ALLOWED_DTYPES, DTYPE_NAMES, bad, decode_dtype,
                                decode_shape)
from ckpt.errors import InvalidStateError


def encode_value(v: Any, path: tuple[str, ...]) -> dict[str, Any]:
  if isinstance(v, (bool, int, float, str, bytes)) and not isinstance(v, np.generic):
    # Subclasses (IntEnum, StrEnum, ...) are stored as their base type, which
    # is all decode_value accepts.
    kind = next(t for t in (bool, int, float, str, bytes) if isinstance(v, t))
    v = kind.__str__(v) if kind is str else kind(v)
    if kind is int and not -2**63 <= v < 2**64:
      raise InvalidStateError(
          f"leaf {tree.path_str(path)!r}: int {v} does not fit in 64 bits")
    return {"py": kind.__name__, "v": v}
  arr = np.asarray(v)
  name = DTYPE_NAMES.get(arr.dtype) or arr.dtype.name
  if name not in ALLOWED_DTYPES:
    raise InvalidStateError(
        f"leaf {tree.path_str(path)!r}: dtype {arr.dtype} cannot be stored; "
        f"expected one of {sorted(ALLOWED_DTYPES)}")
  if not arr.dtype.isnative:  # the bytes are read back as native (little) endian
    arr = arr.astype(arr.dtype.newbyteorder("="))
  return {"np": name, "shape": list(arr.shape),
          "scalar": isinstance(v, np.generic),
          "data": np.ascontiguousarray(arr).tobytes()}


_PY_KINDS = {"bool": bool, "int": int, "float": float, "str": str,
             "bytes": bytes}


def decode_value(d: Any, where: str) -> Any:
  if not isinstance(d, dict):
    raise bad(where, "an inline value map", d)
  if "py" in d:
    kind = _PY_KINDS.get(d["py"]) if isinstance(d["py"], str) else None
    v = d.get("v")
    if kind is None or type(v) is not kind and not (kind is float and type(v) is int):
      raise bad(where, "a bool, int, float, str or bytes value", d)
    return kind(v)
  dtype = decode_dtype(d.get("np"), where)
  shape = decode_shape(d.get("shape"), where)
  data = d.get("data")
  if not isinstance(data, bytes) or len(data) != math.prod(shape) * dtype.itemsize:
    raise bad(where, f"{math.prod(shape) * dtype.itemsize} data bytes",
               f"{len(data) if isinstance(data, bytes) else type(data).__name__}")
  arr = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
  return arr[()] if d.get("scalar") is True else arr
