"""msgpack as tests that craft or edit a step's files need it: indexes of
version 4 on and the per-process checksum files end with a crc32c trailer
(ckpt/format/seal.py), so an edited document is sealed again, and a sealed
file's trailer is stripped before it is unpacked."""

from __future__ import annotations

from typing import Any

import msgpack

from ckpt.format import index as index_lib
from ckpt.format import seal


def _is_sealed_doc(obj: Any) -> bool:
  if not isinstance(obj, dict):
    return False
  version = obj.get("version")
  if type(version) is int and obj.get("format") is not None:
    return version >= index_lib.SEALED_FROM  # an index
  return "process" in obj  # a checksum file or a pack table


def packb(obj: Any, **kwargs) -> bytes:
  """msgpack.packb, sealed when ``obj`` is an index of a sealed version or
  a checksum file's document."""
  data = msgpack.packb(obj, **kwargs)
  return seal.seal(data) if _is_sealed_doc(obj) else data


def unpackb(data: bytes, **kwargs) -> Any:
  """msgpack.unpackb of ``data`` without its crc32c trailer, if it has a
  valid one."""
  body, found, want = seal.split(data)
  return msgpack.unpackb(body if want is not None and found == want else data,
                         **kwargs)
