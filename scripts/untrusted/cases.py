"""Builds the hostile checkpoints of docs/untrusted.md under one directory.

``build(root, preset)`` writes, with this checkout's ckpt, one checkpoint
(or index file) per case and returns ``{case: path}``:

- "nils": an index that is one msgpack array of nils (``nils_bytes``);
- "dups": an index of ``dup_entries`` leaves, each path there twice;
- "huge": a leaf whose shape the index and its ``.zarray`` agree on,
  (2^40, 2^21) float32 (8 PiB);
- "bomb": a leaf of ``bomb_shape`` float32 saved in small chunks, whose
  array is then rewritten as ONE zstd chunk of ones (a small file that
  decodes to the whole leaf).

The presets: "full" (the sizes of docs/untrusted.md) and "smoke" (tiny,
for tests/test_benchmarks_formats_smoke.py).
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import msgpack
import numpy as np

PRESETS = {
    "full": {"nils_bytes": 256 << 20, "dup_entries": 100_000,
             "bomb_shape": (16384, 16384)},
    "smoke": {"nils_bytes": 1 << 20, "dup_entries": 1_000,
              "bomb_shape": (256, 256)},
}


def _save(root: str, state, chunk_bytes: int = 16 << 20) -> str:
  """A one-step checkpoint of ``state`` at ``root``; its step directory."""
  import ckpt  # pylint: disable=g-import-not-at-top
  with ckpt.Checkpointer(root, async_save=False,
                         chunk_bytes=chunk_bytes) as c:
    c.save(1, state)
  return os.path.join(root, "checkpoint_1")


def _read_doc(path: str) -> dict:
  from ckpt.format import seal  # pylint: disable=g-import-not-at-top
  with open(path, "rb") as f:
    return msgpack.unpackb(seal.unseal(f.read(), path), raw=False)


def _write_doc(path: str, doc: dict) -> None:
  from ckpt.format import seal  # pylint: disable=g-import-not-at-top
  with open(path, "wb") as f:
    f.write(seal.seal(msgpack.packb(doc, use_bin_type=True)))


def nils(root: str, nbytes: int) -> str:
  """A checkpoint whose index is one array of ``nbytes`` nils."""
  step = _save(root, {"w": np.ones((256, 256), np.float32)})
  with open(os.path.join(step, "index.msgpack"), "wb") as f:
    f.write(b"\xdd" + struct.pack(">I", nbytes))
    f.write(b"\xc0" * nbytes)
  return root


def dups(root: str, entries: int) -> str:
  """An index file (version 1, unsealed, as old checkpoints are) of
  ``entries`` leaves, each path twice."""
  os.makedirs(root, exist_ok=True)
  leaves = [{"path": [f"p{i % (entries // 2)}"], "kind": "value",
             "value": {"py": "int", "v": 1}} for i in range(entries)]
  doc = {"format": "ckpt", "version": 1, "step": 1, "time": 0.0,
         "storage_format": "zarr", "process_count": 1, "metrics": {},
         "structure": {"node": "none"}, "leaves": leaves, "host_state": None}
  path = os.path.join(root, "dups.msgpack")
  with open(path, "wb") as f:
    f.write(msgpack.packb(doc, use_bin_type=True))
  return path


def huge(root: str) -> str:
  """A checkpoint whose leaf w is (2^40, 2^21) float32 in its index and its
  ``.zarray`` alike."""
  from ckpt.format import entries as entries_lib  # pylint: disable=g-import-not-at-top
  from ckpt.format import index_codec  # pylint: disable=g-import-not-at-top
  step = _save(root, {"w": np.ones((256, 256), np.float32)})
  shape, chunks = [2**40, 2**21], [1, 2**21]
  path = os.path.join(step, "index.msgpack")
  doc = _read_doc(path)
  rows = index_codec.rows(doc["leaves"])
  rows[0].update(shape=shape, chunks=chunks, checksums=[])
  doc["leaves"] = index_codec.columns(rows, entries_lib.KINDS)
  _write_doc(path, doc)
  zarray = os.path.join(step, "w", ".zarray")
  with open(zarray) as f:
    meta = json.load(f)
  meta.update(shape=shape, chunks=chunks)
  with open(zarray, "w") as f:
    json.dump(meta, f)
  return root


def bomb(root: str, shape: tuple[int, int]) -> str:
  """A checkpoint whose leaf w (``shape`` float32, saved in chunks of at
  most a quarter of it) is rewritten as one zstd chunk of ones."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  from ckpt.format import tsspec  # pylint: disable=g-import-not-at-top
  nbytes = shape[0] * shape[1] * 4
  step = _save(root, {"w": np.zeros(shape, np.float32)},
               chunk_bytes=min(16 << 20, nbytes // 4))
  shutil.rmtree(os.path.join(step, "w"))
  spec = tsspec.array_spec("zarr", {"driver": "file", "path": step + "/"},
                           "w", shape, np.float32, shape,
                           tsspec.Codec("zstd", 3))
  ts.open(spec, create=True).result().write(
      np.ones(shape, np.float32)).result()
  return root


def build(root: str, preset: str) -> dict[str, str]:
  """Every case under ``root`` (emptied first); ``{case: path}``."""
  p = PRESETS[preset]
  shutil.rmtree(root, ignore_errors=True)
  return {"nils": nils(os.path.join(root, "nils"), p["nils_bytes"]),
          "dups": dups(os.path.join(root, "dups"), p["dup_entries"]),
          "huge": huge(os.path.join(root, "huge")),
          "bomb": bomb(os.path.join(root, "bomb"), p["bomb_shape"])}
