"""Small leaves, packed: written into a few objects per process.

A leaf of a few KB stored as a TensorStore array costs a metadata file, a
directory, a chunk file and their fsyncs, and a future or two per box: with
10,000 such leaves that per-array work, not the bytes, is the save (see
scripts/bench.py's small_leaves_10k). torch DCP, OLMo-core and Megatron all
aggregate small tensors; ckpt does too:

- An array leaf whose stored bytes are at most ``MAX_LEAF_BYTES`` is packed
  (its index entry is ckpt/pack_index.PackedEntry). 64 KiB: at that size a
  TensorStore array's fixed costs (a few files and fsyncs, several ms) are
  ten to a hundred times the time its bytes take to write, and a pack of
  such leaves stays a few MB per thousand leaves, cheap to read whole.
- Each process concatenates the boxes it owns of packed leaves (the same
  boxes the plan gives it to write, ckpt/shards/plan.py) into packs of at most
  ``MAX_PACK_OBJECT_BYTES`` (and the save's byte budget), each written with
  ONE kvstore write (``ts.KvStore`` on the step's kvstore: disk, gs://,
  s3://, memory; on disk TensorStore's file driver fsyncs it and the commit
  fsyncs the directories, as for arrays). Then its table (pack_index).
- The crc32c of every box is in the table; readers check it on every read
  (ckpt/restore/pack_read.py), so verifying a packed leaf is reading it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

import jax
import numpy as np
import tensorstore as ts

from ckpt.format import pack_index
from ckpt.format import seal
from ckpt.format import pack_table
from ckpt.format import tree
from ckpt.save import staging
from ckpt.store import tsfuture
from ckpt.format.crc import checksum
from ckpt.errors import CheckpointError
from ckpt.store.limiter import ByteLimiter

# Leaves of at most this many stored bytes are packed (0: none).
DEFAULT_MAX_LEAF_BYTES = 64 << 10
MAX_LEAF_BYTES = DEFAULT_MAX_LEAF_BYTES
# One pack object holds at most this many bytes (and at most the budget).
MAX_PACK_OBJECT_BYTES = 64 << 20
# Each box starts at a multiple of this in its pack (aligned reads, views).
ALIGN = 64


def packable(nbytes: int) -> bool:
  return nbytes <= min(MAX_LEAF_BYTES, pack_index.MAX_PACKED_LEAF_BYTES)


def _aligned(n: int) -> int:
  return -(-n // ALIGN) * ALIGN


def group(writes: Sequence[Any], limit: int) -> list[list[Any]]:
  """``writes`` (each with ``nbytes``) cut into packs of at most ``limit``
  aligned bytes (a larger box alone), in order."""
  out: list[list[Any]] = []
  size = limit + 1
  for w in writes:
    n = _aligned(w.nbytes)
    if size + n > limit:
      out.append([])
      size = 0
    out[-1].append(w)
    size += n
  return out


async def write_packs(writes: Sequence[Any], leaves: Sequence[Any],
                      host_boxes: Callable[[list], list[np.ndarray]],
                      step_kvstore: dict, context: ts.Context,
                      limiter: ByteLimiter, process: int,
                      on_pack: Callable[[int, int], None]) -> list:
  """Stages this process's packed ``writes`` (``host_boxes``: their host
  copies, in order) into packs and starts writing each; returns the tasks
  (the last writes the table). ``on_pack(boxes, bytes)`` counts each pack
  written (the bytes of its boxes). Staging is done when this returns: the caller's arrays are no
  longer needed."""
  kv = await tsfuture.wait(ts.KvStore.open(step_kvstore, context=context))
  limit = max(ALIGN, min(MAX_PACK_OBJECT_BYTES, limiter.budget))
  sizes: list[int] = []
  # The table's columns (ckpt/format/pack_table.py), a row per box.
  leaf, pack, offsets, crcs, box = [], [], [], [], []
  tasks: list[asyncio.Task] = []

  async def put(k: int, buf: bytearray, grant: int, count: int,
                data_bytes: int) -> None:
    try:
      await tsfuture.wait(kv.write(pack_index.pack_name(process, k),
                                   bytes(buf)))
      on_pack(count, data_bytes)  # the boxes' bytes (not the alignment)
    except Exception as e:
      raise CheckpointError(
          f"writing pack {pack_index.pack_name(process, k)!r} ({count} boxes "
          f"of small leaves, {len(buf)} bytes) failed: {e}") from e
    finally:
      limiter.release(grant)

  try:
    for k, batch in enumerate(group([w for w in writes if w.box.size],
                                    limit)):
      total = sum(_aligned(w.nbytes) for w in batch)
      grant = await limiter.acquire(total)
      try:
        buf = bytearray(total)
        view = memoryview(buf)
        offset = 0
        for w, data in zip(batch, host_boxes(batch)):
          flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
          n = flat.nbytes
          np.frombuffer(view[offset:offset + n], np.uint8)[:] = flat
          leaf.append(w.leaf)
          pack.append(k)
          offsets.append(offset)
          crcs.append(checksum(flat))
          box += w.box.start
          box += w.box.stop
          offset += _aligned(n)
        del view
      except BaseException:
        limiter.release(grant)
        raise
      sizes.append(total)
      tasks.append(asyncio.ensure_future(put(
          k, buf, grant, len(batch), sum(w.nbytes for w in batch))))
  except BaseException:
    await asyncio.gather(*tasks, return_exceptions=True)
    raise
  if not leaf:
    return tasks
  table = seal.seal(pack_table.encode(process, sizes, leaf, pack, offsets,
                                      crcs, box))
  if len(table) > pack_index.MAX_TABLE_BYTES:
    raise CheckpointError(
        f"the pack table of process {process} is {len(table)} bytes; readers "
        f"accept at most {pack_index.MAX_TABLE_BYTES}: lower "
        "ckpt.save.pack.MAX_LEAF_BYTES")

  async def put_table() -> None:
    await asyncio.gather(*tasks[:len(sizes)])  # the packs first
    try:
      await tsfuture.wait(kv.write(pack_index.table_name(process), table))
    except Exception as e:
      raise CheckpointError(
          f"writing the pack table {pack_index.table_name(process)!r} "
          f"failed: {e}") from e

  tasks.append(asyncio.ensure_future(put_table()))
  return tasks


def host_boxes(plan: Any, writes: list) -> list[np.ndarray]:
  """Stage 3 for a pack's boxes: every device-to-host copy started, then
  each box on the host (ckpt/save/staging.py; copied into the pack at
  once, so borrowed). ``plan``: a leaves.SavePlan."""
  shards: dict[int, dict] = {}  # leaf -> device id -> shard (once per leaf)
  pieces = []
  for w in writes:
    leaf = plan.leaves[w.leaf]
    try:
      src = leaf.source
      if isinstance(src, jax.Array):
        by_id = shards.get(w.leaf)
        if by_id is None:
          by_id = shards[w.leaf] = {sh.device.id: sh
                                    for sh in src.addressable_shards}
        shard = by_id[w.device]
        piece = shard.data
        if w.box != w.shard and staging.cut_on_device(shard.device):
          piece = piece[w.box.relative_to(w.shard)]
        if not staging.is_view(leaf, piece):
          piece.copy_to_host_async()
      else:
        piece = staging.device_piece(leaf, w)
      pieces.append(piece)
    except Exception as e:
      raise CheckpointError(
          f"leaf {tree.path_str(leaf.parts)!r}: starting the copy of "
          f"{w.box.start}..{w.box.stop} to the host failed (was the array "
          f"deleted or donated before save() returned?): {e}") from e
  out = []
  for w, piece in zip(writes, pieces):
    out.append(staging.host_box(plan.leaves[w.leaf], w, piece, borrow=True))
  return out
