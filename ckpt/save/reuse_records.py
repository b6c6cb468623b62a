"""Reuse across restarts: the generations a new Checkpointer starts from.

A job restarted on the same root (a new Checkpointer, a new process) knows
nothing in memory of what it stored. Each committed step saved with
``reuse_unchanged=True`` records it: its ``.reuse/<process>.msgpack``
(sealed) lists every chunk that process stored, with its xxh3-128 hash,
its crc32c and its stamp (ckpt/save/reuse_source.py), and its index says
each leaf's layout and, on a bucket, which step's data directory holds it.
``load`` rebuilds from them the ``Generation`` of the newest committed
steps, once, at the first save of a Checkpointer; no stored byte is hashed
again. What is stored is not trusted for it: before any link (hold) the
chunk is checked against its recorded stamp, as within one run.

Anything that does not fit (another format or process count, records
without stamps from an older ckpt, a file damaged, over the limits or
missing) makes that step none to compare with: its chunks are written.
Paths come from step numbers and checked attempt names, never from a file.
"""

from __future__ import annotations

import math
from typing import Any

from absl import logging
import msgpack
import numpy as np

from ckpt.commit import steps as steps_lib
from ckpt.format import entries
from ckpt.format import index as index_lib
from ckpt.format import seal
from ckpt.save.reuse_source import Generation, Stored

HASH_NAME = "xxh3_128"



def encode(process: int, relpaths: list, generation: Generation,
           source_step: int | None, written: int, reused: int) -> bytes:
  """A process's ``.reuse`` file (msgpack, sealed by the caller): per chunk
  ``[leaf, start, stop, xxh3-128 or nil, crc32c, stamp or nil]``, the step
  it linked from, its bytes written and reused. The chunk list is left out
  (nil) where it would pass the size readers accept (a million chunks and
  more on one process): the totals stay."""
  leaf_of = {r: i for i, r in enumerate(relpaths) if r is not None}
  records = [[leaf_of[r], list(start), list(stop), s.digest, s.crc, s.stamp]
             for (r, start, stop), s in generation.chunks.items()]
  doc = {"process": process, "hash": HASH_NAME, "from": source_step,
         "written": written, "reused": reused, "chunks": records}
  data = msgpack.packb(doc, use_bin_type=True)
  if len(data) > index_lib.MAX_PROCESS_FILE_BYTES - 64:
    data = msgpack.packb({**doc, "chunks": None}, use_bin_type=True)
  return data

def _index(storage: Any, step_dir: str) -> index_lib.Index:
  data = storage.read_bytes(storage.index_key(step_dir),
                            limit=index_lib.MAX_INDEX_BYTES)
  if data is None:
    raise ValueError("it has no index")
  return index_lib.decode(data, f"{storage.url.rstrip('/')}/{step_dir}")


def _ints(v: Any, rank: int) -> tuple[int, ...]:
  if (not isinstance(v, list) or len(v) != rank or
      any(type(x) is not int or x < 0 for x in v)):
    raise ValueError(f"a box bound {v!r} is not {rank} non-negative ints")
  return tuple(v)


def _chunks(doc: Any, index: index_lib.Index, pid: int
            ) -> dict[tuple[str, tuple, tuple], Stored]:
  """The chunk records of one process's ``.reuse`` file, each checked."""
  if (not isinstance(doc, dict) or doc.get("process") != pid or
      doc.get("hash") != HASH_NAME or not isinstance(doc.get("chunks"), list)):
    raise ValueError("it is not a reuse record of this process with chunks")
  out = {}
  for rec in doc["chunks"]:
    if not isinstance(rec, list) or len(rec) != 6:
      raise ValueError("its records have no stamps (an older ckpt)")
    leaf, start, stop, digest, crc, stamp = rec
    if type(leaf) is not int or not 0 <= leaf < len(index.leaves):
      raise ValueError(f"leaf {leaf!r} is not one of the index's")
    e = index.leaves[leaf]
    if not isinstance(e, entries.ArrayEntry):
      raise ValueError(f"leaf {leaf} is not a stored array")
    start, stop = _ints(start, len(e.shape)), _ints(stop, len(e.shape))
    if any(a >= b or b > s for a, b, s in zip(start, stop, e.shape)):
      raise ValueError(f"box {start}..{stop} is not inside {e.shape}")
    if not (digest is None or (isinstance(digest, bytes) and
                               len(digest) == 16)):
      raise ValueError("a hash is not 16 bytes")
    if type(crc) is not int or not 0 <= crc < 2**32:
      raise ValueError("a crc32c is not a 32-bit int")
    if not (stamp is None or (isinstance(stamp, bytes) and len(stamp) <= 256)):
      raise ValueError("a stamp is not bytes")
    nbytes = math.prod(b - a for a, b in zip(start, stop)) * np.dtype(
        e.dtype).itemsize
    out[(e.relpath, start, stop)] = Stored(digest, crc, nbytes, stamp)
  return out


def _generation(storage: Any, step: int, fmt: str, layout_of: Any,
                pid: int, count: int) -> Generation:
  """What process ``pid`` stored in the committed ``step``; ValueError
  (or a CheckpointError) when it cannot be compared with."""
  token = steps_lib.committed_attempt(storage, step)
  if token is None:
    raise ValueError("its commit does not name its attempt")
  step_dir = steps_lib.step_dir(storage, step)
  index = _index(storage, step_dir)
  if index.storage_format != fmt or index.process_count != count:
    raise ValueError(f"it was saved in format {index.storage_format!r} by "
                     f"{index.process_count} processes")
  rel = index_lib.process_file(index_lib.REUSE_DIR, pid, step_dir)
  data = storage.read_bytes(rel, limit=index_lib.MAX_PROCESS_FILE_BYTES)
  if data is None:
    raise ValueError(f"it has no {rel}")
  doc = index_lib.unpack(seal.maybe_unseal(data, rel, index.sealed))
  own = step_dir.split("/", 1)[1] if "/" in step_dir else ""
  layouts, holders = {}, {}
  for e in index.leaves:
    if isinstance(e, entries.ArrayEntry) and e.ocdbt_group is None:
      layouts[e.relpath] = layout_of(fmt, e, e.codec.get("checksum", "none"))
      held = e.held_by
      if held is not None:
        entries.held_dir(held)  # checked: a step and an attempt name
      holders[e.relpath] = tuple(held) if held is not None else (step, own)
  return Generation(step, token, layouts, _chunks(doc, index, pid),
                    holders if not storage.is_posix else {})


def load(storage: Any, fmt: str, layout_of: Any, pid: int, count: int,
         copies: int) -> list[Generation | None]:
  """Blocking: the generations of the ``copies`` newest committed steps of
  the root, oldest first (None for a step that cannot be compared with)."""
  try:
    steps = steps_lib.committed_steps(storage)[-copies:]
  except Exception as e:  # pylint: disable=broad-except
    logging.info("ckpt: reuse_unchanged=True finds no committed steps in "
                 "%s to compare with (%s): this save writes every chunk",
                 storage.url, e)
    return []
  out = []
  for step in steps:
    try:
      out.append(_generation(storage, step, fmt, layout_of, pid, count))
    except Exception as e:  # pylint: disable=broad-except
      logging.info("ckpt: reuse_unchanged=True does not compare with step "
                   "%d in %s: %s", step, storage.url, e)
      out.append(None)
  return out
