"""``ckpt inspect`` and ``ckpt verify``: one checkpoint's tree (shapes, dtypes, chunks, codec,
saved sharding, inline values, PRNG keys) from its index, and every stored byte of it (or of
every committed step of a root) read back and checked against its checksum.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np

from ckpt.commit import steps as steps_lib
from ckpt.cli import convert
from ckpt.cli.listing import open_root
from ckpt.cli.output import (Progress, brief, emit, human_bytes, iso_utc,
                             jsonable, local_time, metrics_text, table)
from ckpt.cli.usage import EXIT_FAIL, EXIT_OK, UsageError
from ckpt.format import index as index_lib
from ckpt.errors import CheckpointError
from ckpt.format import entries
from ckpt.format import pack_index
from ckpt.format import root_metadata


# ---- inspect -----------------------------------------------------------------

def leaf_info(e: entries.Entry) -> dict[str, Any]:
  from ckpt.format import tree  # pylint: disable=g-import-not-at-top
  name = tree.path_str(e.path)
  if isinstance(e, entries.ArrayEntry):
    grid = [math.ceil(s / c) if c else 0 for s, c in zip(e.shape, e.chunks)]
    return {"path": name, "kind": "array", "shape": list(e.shape),
            "dtype": e.dtype, "source_dtype": e.source_dtype,
            "bytes": convert.leaf_nbytes(e), "chunks": list(e.chunks),
            "chunk_count": math.prod(grid), "codec": e.codec,
            "sharding": e.sharding, "relpath": e.relpath,
            "checksums": len(getattr(e, "checksums", ())),
            **_prng_info(e, e.shape)}
  if isinstance(e, pack_index.PackedEntry):  # in the step's packs
    return {"path": name, "kind": "packed", "shape": list(e.shape),
            "dtype": e.dtype, "source_dtype": e.source_dtype,
            "bytes": convert.leaf_nbytes(e), "sharding": e.sharding,
            **_prng_info(e, e.shape)}
  v = e.value
  is_np = isinstance(v, (np.ndarray, np.generic))
  return {"path": name, "kind": "value",
          "type": np.asarray(v).dtype.name if is_np else type(v).__name__,
          "shape": list(np.shape(v)) if is_np else None,
          "bytes": convert.leaf_nbytes(e), "value": jsonable(v),
          "repr": brief(v), **_prng_info(e, np.shape(v))}


def _prng_info(e: entries.Entry, shape) -> dict[str, Any]:
  """``prng_impl``: the implementation of a typed PRNG key leaf (None for
  other leaves); a key leaf's ``shape`` and ``dtype`` are its stored key
  data's, ``keys_shape`` the shape of the key array it restores as."""
  impl = getattr(e, "prng_impl", "") or None
  if impl is None:
    return {"prng_impl": None}
  from ckpt.format import prng  # pylint: disable=g-import-not-at-top
  k = len(prng.info(impl).key_shape)  # the index was validated on read
  return {"prng_impl": impl, "keys_shape": list(shape[:len(shape) - k])}


def _codec_text(codec: dict) -> str:
  if not codec.get("compression"):
    return "raw"
  level = codec.get("level")
  return f"{codec['compression']}({level})" if level is not None else \
      codec["compression"]


def _key_text(x: dict[str, Any]) -> str:
  """The DTYPE cell of a PRNG key leaf: ``key<rbg>``."""
  return f"key<{x['prng_impl']}>"


def _shape_text(shape) -> str:
  return "(" + ", ".join(str(d) for d in shape) + (",)" if len(shape) == 1
                                                    else ")")


def reuse_summary(storage, step_dir: str, index: index_lib.Index
                  ) -> dict[str, Any] | None:
  """The bytes of a step its processes wrote (``own_bytes``) and linked
  from an earlier step (``reused_from``: {step: bytes}), from the
  ``.reuse`` files of ``reuse_unchanged=True`` (ckpt/save/reuse.py); None
  if the step was saved without it. A process whose file is missing or
  unreadable is counted in ``unknown_processes`` (the first 100 missing:
  the files there are come from one listing, never one read per process
  the index claims, ckpt/restore/listed.py)."""
  from ckpt.format import seal  # pylint: disable=g-import-not-at-top
  from ckpt.restore import listed  # pylint: disable=g-import-not-at-top
  own, reused, unknown, found = 0, {}, [], 0
  count = min(index.process_count, index_lib.MAX_PROCESSES)
  present = listed.process_numbers(listed.list_names(
      storage, f"{step_dir}/{index_lib.REUSE_DIR}".lstrip("/")),
      ".msgpack", count)
  have = set(present)
  missing = (p for p in range(count) if p not in have)
  unknown = [p for _, p in zip(range(100 if len(have) < count else 0),
                               missing)]
  for p in present:
    rel = index_lib.process_file(index_lib.REUSE_DIR, p, step_dir)
    try:
      data = storage.read_bytes(rel, limit=index_lib.MAX_PROCESS_FILE_BYTES)
      if data is None:  # deleted since the listing
        unknown.append(p)
        continue
      doc = index_lib.unpack(seal.maybe_unseal(data, rel, index.sealed))
      written, n, src = doc["written"], doc["reused"], doc["from"]
      if (doc.get("process") != p or type(written) is not int or
          type(n) is not int or min(written, n) < 0 or
          not (src is None or type(src) is int)):
        raise ValueError("not a reuse record")
    except Exception:  # pylint: disable=broad-except
      unknown.append(p)
      continue
    found += 1
    own += written
    if n:
      reused[src] = reused.get(src, 0) + n
  if not found:
    return None
  held = {}  # a bucket: the arrays held by earlier steps (index version 6)
  for e in index.leaves:
    if getattr(e, "held_by", None) is not None:
      n = int(np.prod(e.shape, dtype=np.int64)) * np.dtype(e.dtype).itemsize
      held[e.held_by[0]] = held.get(e.held_by[0], 0) + n
  if held:  # by the step that holds them, not the one compared with
    reused = held
  return {"own_bytes": own, "reused_bytes": sum(reused.values()),
          "reused_from": {str(s): n for s, n in sorted(reused.items())},
          "how": "held by reference" if held else "hard links",
          "unknown_processes": sorted(unknown)}


def _reuse_text(r: dict[str, Any]) -> str:
  src = ", ".join(f"{human_bytes(n)} from step {s}"
                  for s, n in r["reused_from"].items())
  text = (f"stored    {human_bytes(r['own_bytes'])} its own, " +
          (f"{human_bytes(r['reused_bytes'])} reused ({src}, {r['how']})"
           if src else "nothing reused"))
  if r["unknown_processes"]:
    text += f"; no record of process(es) {r['unknown_processes'][:10]}"
  return text


def cmd_inspect(args) -> int:
  storage, step_dir, index = convert.open_checkpoint(
      args.path, args.step, args.storage_options)
  where = storage.url.rstrip("/") + (f"/{step_dir}" if step_dir else "")
  leaves = [leaf_info(e) for e in index.leaves]
  arrays = [x for x in leaves if x["kind"] in ("array", "packed")]
  doc = {"path": where, "step": index.step, "time": index.time,
         "time_iso": iso_utc(index.time), "format": index.storage_format,
         "process_count": index.process_count, "metrics": index.metrics,
         "array_bytes": sum(x["bytes"] for x in arrays), "leaves": leaves,
         "custom_metadata": index_lib.custom_metadata_of(index),
         "temporary": index.temporary,
         # The root's (a root was given): Checkpointer(custom_metadata=).
         "root_metadata": (root_metadata.read(storage) if step_dir else None),
         "reuse": reuse_summary(storage, step_dir, index)}
  rows = []
  for x in leaves:
    if x["kind"] in ("array", "packed"):
      dtype = x["dtype"] if x["source_dtype"] == x["dtype"] else \
          f"{x['source_dtype']}->{x['dtype']}"
      shape = _shape_text(x["shape"])
      if x["prng_impl"]:  # keys: their shape, not their key data's
        shape, dtype = _shape_text(x["keys_shape"]), _key_text(x)
      packed = x["kind"] == "packed"  # in the step's packs: no chunks
      rows.append([x["path"], shape, dtype,
                   human_bytes(x["bytes"]),
                   "packed" if packed else
                   f"{_shape_text(x['chunks'])} x{x['chunk_count']}",
                   "crc32c" if packed else _codec_text(x["codec"]),
                   x["sharding"] or "-"])
    else:
      shape = "-" if x["shape"] is None else _shape_text(x["shape"])
      kind, value = x["type"], f"= {x['repr']}"
      if x["prng_impl"]:
        shape, kind = _shape_text(x["keys_shape"]), _key_text(x)
        value = f"= key data {x['repr']}"
      rows.append([x["path"], shape, kind, "inline", "-", "-", value])
  head = [
      f"checkpoint {where} (step {index.step})",
      f"saved     {local_time(index.time)} by {index.process_count} "
      f"process{'es' if index.process_count != 1 else ''}",
      f"format    {index.storage_format}; {len(leaves)} leaves: "
      f"{len(arrays)} arrays ({human_bytes(doc['array_bytes'])}), "
      f"{len(leaves) - len(arrays)} inline values",
  ]
  if index.temporary:
    head.append("temporary saved only by save_interval_secs: deleted once a "
                "newer step commits (temporary_time_saves)")
  if doc["reuse"] is not None:
    head.append(_reuse_text(doc["reuse"]))
  keys = [x for x in leaves if x["prng_impl"]]
  if keys:
    impls = ", ".join(sorted({x["prng_impl"] for x in keys}))
    head.append(f"prng keys {len(keys)} leaves hold typed PRNG keys ({impls}), "
                "stored as their key data")
  if index.metrics:
    head.append(f"metrics   {metrics_text(index.metrics)}")
  if doc["custom_metadata"]:
    custom = json.dumps(doc["custom_metadata"], sort_keys=True)
    head.append("custom    " + (custom if len(custom) <= 400 else
                                 f"{custom[:400]}... ({len(custom)} chars; "
                                 "--json shows all)"))
  if doc["root_metadata"]:
    root = json.dumps(doc["root_metadata"], sort_keys=True)
    head.append("root      " + (root if len(root) <= 400 else
                                 f"{root[:400]}... ({len(root)} chars; "
                                 "--json shows all)"))
  text = "\n".join(head)
  if rows:
    text += "\n\n" + table(
        ["PATH", "SHAPE", "DTYPE", "SIZE", "CHUNKS", "CODEC",
         "SHARDING (SAVED) / VALUE"], rows, right=("SIZE",))
  emit(args, doc, text)
  return EXIT_OK


# ---- verify ------------------------------------------------------------------

def _verify_one(args, step: int | None) -> dict[str, Any]:
  from ckpt.cli import integrity  # pylint: disable=g-import-not-at-top
  storage, step_dir, index = convert.open_checkpoint(
      args.path, step, args.storage_options)
  where = storage.url.rstrip("/") + (f"/{step_dir}" if step_dir else "")
  arrays = [e for e in index.leaves
            if isinstance(e, (entries.ArrayEntry, pack_index.PackedEntry))]
  t0 = time.perf_counter()
  with Progress(args, f"verify step {index.step}", unit="leaf") as bar:
    problems = integrity.verify(args.path, step=step,
                                storage_options=args.storage_options,
                                progress=bar)
  return {"path": where, "step": index.step, "ok": not problems,
          "arrays": len(arrays),
          "bytes": sum(convert.leaf_nbytes(e) for e in arrays),
          "seconds": round(time.perf_counter() - t0, 3),
          "problems": [{"path": p.path, "message": p.message}
                       for p in problems]}


def cmd_verify(args) -> int:
  if args.all:
    if args.step is not None:
      raise UsageError("pass --step or --all, not both")
    steps = steps_lib.committed_steps(open_root(args, args.path))
    if not steps:
      raise CheckpointError(f"{args.path} holds no committed checkpoint")
    results = [_verify_one(args, s) for s in steps]
    doc: dict[str, Any] = {"ok": all(r["ok"] for r in results),
                           "checkpoints": results}
  else:
    results = [_verify_one(args, args.step)]
    doc = results[0]
  lines = []
  for r in results:
    for p in r["problems"]:
      lines.append(f"CORRUPT {p['path']}: {p['message']}")
    verdict = ("all checksums match" if r["ok"] else
               f"{len(r['problems'])} of {r['arrays']} arrays corrupt")
    lines.append(f"step {r['step']} ({r['path']}): {r['arrays']} arrays, "
                 f"{human_bytes(r['bytes'])} read; {verdict} "
                 f"({r['seconds']:.1f} s)")
  emit(args, doc, "\n".join(lines))
  return EXIT_OK if all(r["ok"] for r in results) else EXIT_FAIL
