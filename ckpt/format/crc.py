"""The crc32c of an array's bytes: the checksum taken of every box at save
(format "zarr" per-process checksum files, packed pieces) and of the
agreement payloads between hosts, and checked again on read
(ckpt/restore/checksums.py). Depends on nothing in ckpt.
"""

from __future__ import annotations

import crc32c
import numpy as np


def checksum(data: np.ndarray) -> int:
  """crc32c of an array's bytes in C order (hardware-accelerated)."""
  data = np.ascontiguousarray(data)
  return crc32c.crc32c(data.reshape(-1).view(np.uint8))
