"""A crc32c trailer on the small files of a step: the index and each
process's files (checksums, host_state, pack tables).

A flipped byte in one of them could otherwise decode into another valid
value unnoticed (a metric, an inline leaf, an offset, a count). Since index
version 4 each ends with six bytes, a msgpack bin of 4 bytes holding the
crc32c of everything before it (big-endian)::

    <msgpack document> c4 04 <crc32c>

The trailer is what makes a file checkable, so a reader never guesses: an
index is sealed exactly when its version is 4 or more (a sealed index read
as unsealed fails to decode: the trailer is extra data), and a step's
per-process files are sealed exactly when its index is. Depends on nothing
in ckpt but its errors.
"""

from __future__ import annotations

import crc32c

from ckpt.errors import CorruptCheckpointError

_TAG = b"\xc4\x04"
TRAILER_BYTES = len(_TAG) + 4


def seal(body: bytes) -> bytes:
  """``body`` followed by its crc32c trailer."""
  return body + _TAG + crc32c.crc32c(body).to_bytes(4, "big")


def split(data: bytes) -> tuple[bytes, int | None, int | None]:
  """(body, found crc32c, recorded crc32c) of ``data`` read as sealed; the
  crcs are None when ``data`` has no trailer at all."""
  if len(data) < TRAILER_BYTES or data[-TRAILER_BYTES:-4] != _TAG:
    return data, None, None
  body = data[:-TRAILER_BYTES]
  return body, crc32c.crc32c(body), int.from_bytes(data[-4:], "big")


def unseal(data: bytes, where: str) -> bytes:
  """The body of a sealed file; CorruptCheckpointError naming ``where``,
  the expected and the found checksum when it does not match."""
  body, found, want = split(data)
  if want is None:
    raise CorruptCheckpointError(
        f"{where}: expected a crc32c trailer (the step's index is version 4 "
        "or later, so every one of its files has one); found none: the file "
        "was truncated, damaged or replaced")
  if found != want:
    raise CorruptCheckpointError(
        f"{where}: its bytes have crc32c {found:#010x}, the trailer records "
        f"{want:#010x}: the file was damaged after it was written")
  return body


def maybe_unseal(data: bytes, where: str, sealed: bool) -> bytes:
  """``unseal`` for files that are sealed (``sealed``), else ``data``."""
  return unseal(data, where) if sealed else data
