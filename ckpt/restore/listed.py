"""What a step holds of its per-process files, from one listing.

An index says how many processes saved the step (``process_count``, at most
index.MAX_PROCESSES = 2**20 by the format's bounds). A reader that works per
claimed process (a request, a coroutine, a table each) would let a 6-byte
edit of a sealed index cost minutes and gigabytes before the first missing
file stops it. So a reader lists the directory of those files once, compares
what the index claims with what is there, and then works only on files that
exist: the cost follows what the step holds, never what its index claims.

Names are parsed here, never trusted: only ``<process><suffix>`` with a
canonical decimal process number below the index's count is taken; a file
name is then built again from that number (index.process_file,
pack_index.table_name).
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from ckpt.format import index as index_lib


def list_names(storage: Any, rel_dir: str) -> list[str]:
  """The names of the files directly in ``rel_dir`` (relative to the
  storage root; [] if it does not exist): one ``listdir`` on a disk, one
  listing (paged by the server) on an object store."""
  rel_dir = rel_dir.strip("/")
  with storage.store_errors(f"listing {rel_dir!r} in"):
    if storage.is_posix:
      try:
        return os.listdir(os.path.join(os.fspath(storage.root), rel_dir))
      except (FileNotFoundError, NotADirectoryError):
        return []
    prefix = f"{rel_dir}/"
    return [k[len(prefix):] for k in storage.list_keys(prefix)
            if "/" not in k[len(prefix):]]


def process_numbers(names: Iterable[str], suffix: str, count: int
                    ) -> list[int]:
  """The process numbers below ``count`` of the names ``<process><suffix>``
  in ``names``, sorted; any other name is ignored."""
  out = set()
  for name in names:
    if not name.endswith(suffix):
      continue
    stem = name[:-len(suffix)]
    if (stem.isascii() and stem.isdigit() and len(stem) <= 7 and
        (stem == "0" or stem[0] != "0")):
      p = int(stem)
      if p < min(count, index_lib.MAX_PROCESSES):
        out.add(p)
  return sorted(out)


def first_missing(present: list[int], count: int) -> int | None:
  """The smallest process number in [0, count) not in ``present`` (sorted,
  without duplicates, each below ``count``), or None if none is missing."""
  if len(present) >= count:
    return None
  for i, p in enumerate(present):
    if p != i:
      return i
  return len(present)
