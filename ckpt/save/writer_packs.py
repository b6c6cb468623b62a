"""Packs of small leaves, written by the writer process (writer="process").

The trainer (ckpt/save/handed.py) cuts its boxes of small leaves into the
packs the thread writer makes (ckpt/save/pack.py: the same packs, in the
same order, each box at the same aligned offset) and joins each pack
straight into a shared-memory segment; the writer process takes the crc32c
of each box there, writes the pack as one object
(``.packs/<process>.<k>.bin``) and, once every pack is written, the
process's table (``.packs/<process>.msgpack``, ckpt/format/pack_table.py),
its rows in the order the thread writer gives them. So a step saved with
the writer process is laid out byte for byte as a thread save of the same
state.

Call sequence (on the writer's pool threads): ``write(m, data)`` for each
``pack`` message, then ``finish()`` once every pack's write ended.
"""

from __future__ import annotations

import threading

import crc32c
import tensorstore as ts

from ckpt.errors import CheckpointError
from ckpt.format import pack_index
from ckpt.save import pack as pack_lib
from ckpt.store import deadline as deadline_lib


class PackSink:
  """One save's packs on one writer process (see the module docstring)."""

  def __init__(self, step_kvstore: dict, context: ts.Context, process: int):
    self.step_kvstore, self.context = step_kvstore, context
    self.process = process
    self._lock = threading.Lock()
    self._kv: ts.KvStore | None = None
    self._rows: dict[int, tuple] = {}  # pack k: (size, leaf, offset, crc, box)

  def _kvstore(self) -> ts.KvStore:
    with self._lock:
      if self._kv is None:
        self._kv = deadline_lib.result(ts.KvStore.open(
            self.step_kvstore, context=self.context))
      return self._kv

  def write(self, m: dict, data: memoryview) -> None:
    """Pack ``m["k"]`` (its bytes ``data``, joined by the trainer) written,
    its boxes' crc32c taken and kept for the table."""
    k, n = int(m["k"]), len(m["leaves"])
    if not (len(m["offsets"]) == len(m["sizes"]) == len(m["boxes"]) == n):
      raise ValueError(f"pack {k}: {n} leaves, {len(m['offsets'])} offsets, "
                       f"{len(m['sizes'])} sizes, {len(m['boxes'])} boxes")
    crcs = [crc32c.crc32c(data[o:o + s])
            for o, s in zip(m["offsets"], m["sizes"])]
    boxes = []
    for start, stop in m["boxes"]:
      boxes += start
      boxes += stop
    name = pack_index.pack_name(self.process, k)
    try:
      deadline_lib.result(self._kvstore().write(name, bytes(data)))
    except Exception as e:
      raise CheckpointError(
          f"writing pack {name!r} ({n} boxes of small leaves, {len(data)} "
          f"bytes) failed: {e}") from e
    with self._lock:
      self._rows[k] = (len(data), list(m["leaves"]), list(m["offsets"]),
                       crcs, boxes)

  def finish(self) -> None:
    """The table, once every pack is written (nothing when none was)."""
    if not self._rows:
      return
    ks = sorted(self._rows)
    if ks != list(range(len(ks))):
      raise CheckpointError(f"the packs of process {self.process} are "
                            f"{ks}, not 0..{len(ks) - 1}")
    sizes, leaf, pack, offsets, crcs, box = [], [], [], [], [], []
    for k in ks:
      size, leaves, offs, sums, boxes = self._rows[k]
      sizes.append(size)
      leaf += leaves
      pack += [k] * len(leaves)
      offsets += offs
      crcs += sums
      box += boxes
    name, table = pack_lib.sealed_table(self.process, sizes, leaf, pack,
                                        offsets, crcs, box)
    try:
      deadline_lib.result(self._kvstore().write(name, table))
    except Exception as e:
      raise CheckpointError(
          f"writing the pack table {name!r} failed: {e}") from e
