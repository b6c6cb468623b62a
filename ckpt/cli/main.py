"""The ``ckpt`` command: look at, check, clean up and convert checkpoints.

  ckpt ls DIR                        steps, committed or not, size, metrics
  ckpt inspect PATH [--step S]       the tree: shapes, dtypes, chunks, sharding
  ckpt verify PATH [--step S|--all]  every stored byte against its checksum
  ckpt gc DIR --keep N [...]         what retention would delete; --yes deletes
  ckpt export PATH --to FMT OUT      one safetensors or npz file
  ckpt import SRC DIR --step S       from an Orbax checkpoint or safetensors

PATH is a checkpoint root (then ``--step``, default the latest committed) or
one step directory. Every command takes ``--json`` (one JSON document on
stdout) and ``--quiet``; progress bars go to stderr, and only when it is a
terminal. Errors are one line on stderr. Exit status: 0 success, 1 an error
or (verify) corruption found, 2 bad usage.

The command reads on the CPU (it never claims the accelerators of a machine
that is training) unless ``JAX_PLATFORMS`` says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from ckpt.commit import protocol as commit_lib
from ckpt.cli import convert
from ckpt.commit import deletion
from ckpt.cli.output import (Progress, brief, emit, human_age, human_bytes,
                             iso_utc, jsonable, local_time, metrics_text,
                             table)
from ckpt.format import index as index_lib
from ckpt.restore import read as restore_lib
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError
from ckpt.commit.retention import RetentionPolicy

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
DEFAULT_TMP_MIN_AGE_S = 3600


class UsageError(CheckpointError):
  """Arguments that parse but do not make sense together."""


# ---- looking at a root -----------------------------------------------------

def open_root(args, directory: str) -> storage_lib.Storage:
  storage = storage_lib.Storage(directory, args.storage_options)
  if storage.is_posix:
    path = storage.spec["path"].rstrip("/") or "/"
    if not os.path.exists(path):
      raise CheckpointError(f"{directory} does not exist")
    if not os.path.isdir(path):
      raise CheckpointError(f"{directory} is not a directory")
  if storage.read_bytes(storage_lib.INDEX_NAME) is not None:
    raise UsageError(f"{directory} is one checkpoint (a step directory), "
                     "not a root of checkpoint_<step> directories; run "
                     f"`ckpt inspect {directory}`")
  return storage


def _disk_usage(path: str) -> tuple[int, int, float | None]:
  """(bytes, files, newest mtime) under ``path``; races with deletes are
  tolerated (what vanished is not counted)."""
  total = files = 0
  newest = None
  for dirpath, _, names in os.walk(path):
    for name in names:
      try:
        st = os.lstat(os.path.join(dirpath, name))
      except OSError:
        continue
      total += st.st_size
      files += 1
      newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
  return total, files, newest


def _object_counts(storage: storage_lib.Storage) -> dict[str, int]:
  """Objects per top-level ``checkpoint_*`` prefix of an object store."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  kv = ts.KvStore.open(storage.spec, context=storage.context()).result()
  prefix = storage_lib.STEP_PREFIX
  rng = ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))
  counts: dict[str, int] = {}
  for key in kv.list(rng).result():
    head = key.decode().partition("/")[0]
    counts[head] = counts.get(head, 0) + 1
  return counts


def _step_of(name: str) -> int:
  return commit_lib.step_of(name)


def list_entries(storage: storage_lib.Storage, progress=None,
                 count_objects: bool = False) -> list[dict]:
  """Every checkpoint_* entry of a root: committed, uncommitted (a save in
  progress or abandoned; on an object store also ``pending/<step>.delete``,
  a deletion that did not finish), incomplete (a disk's step directory
  without its commit marker or its index, with ``problem`` saying which,
  or one a save set aside: ``checkpoint_<step>.broken-*``) or corrupt (bad
  index).

  On an object store this costs one listing of ``commits/`` and one of
  ``pending/`` (plus a GET of each step's record and index), whatever the
  number of chunks; ``count_objects`` adds the objects of each step, from
  one listing of every key under ``checkpoint_*`` (a LIST page per 1,000
  keys: millions of chunks are thousands of pages), else ``files`` is None."""
  committed = commit_lib.committed_steps(storage)
  rows: dict[str, dict] = {}
  for s in committed:
    name = storage_lib.step_dirname(s)
    row = {"step": s, "name": name, "status": "committed"}
    try:
      index = restore_lib.read_index(storage, commit_lib.step_dir(storage, s))
      row.update(time=index.time, metrics=index.metrics,
                 format=index.storage_format,
                 process_count=index.process_count, leaves=len(index.leaves),
                 data_bytes=sum(convert.leaf_nbytes(e) for e in index.leaves))
    except CheckpointError as e:
      row.update(status="corrupt", error=str(e))
    rows[name] = row
  for name in commit_lib.abandoned(storage, 0.0):  # every uncommitted attempt
    rows[name] = {"step": _step_of(name), "name": name,
                  "status": "uncommitted"}
  if storage.is_posix:
    for p in os.listdir(storage.spec["path"]):
      if not os.path.isdir(os.path.join(storage.spec["path"], p)):
        continue  # a file named checkpoint_<n> is not ckpt's
      s = storage_lib.parse_step(p)
      aside = storage_lib.parse_broken(p)
      if s is not None and p not in rows:
        rows[p] = {"step": s, "name": p, "status": "incomplete",
                   "problem": commit_lib.posix_problem(storage, p)}
      elif aside is not None:
        problem = commit_lib.posix_problem(storage, p)
        rows[p] = {"step": aside, "name": p, "status": "incomplete",
                   "problem": f"set aside by a later save of step {aside}"
                   + (f"; it {problem}" if problem else "")}
    now = time.time()
    for i, row in enumerate(rows.values()):
      size, files, mtime = _disk_usage(
          os.path.join(storage.spec["path"], row["name"]))
      row.update(bytes=size, files=files)
      if row["status"] != "committed":
        row["time"] = mtime
        row["age_s"] = None if mtime is None else max(0.0, now - mtime)
      if progress:
        progress(i + 1, len(rows))
  else:
    counts = _object_counts(storage) if count_objects else None
    for row in rows.values():
      row.update(bytes=None, files=(None if counts is None else
                                    counts.get(row["name"], 0)))
      row.setdefault("age_s", None)  # object stores give no times here
  out = sorted(rows.values(), key=lambda r: (r["step"], r["name"]))
  for row in out:
    row.setdefault("time", None)
    row["time_iso"] = iso_utc(row["time"])
  return out


_STATUS_NOTE = {
    "uncommitted": "a save in progress, or abandoned by one that crashed",
    "deletion": "a deletion that did not finish (a writer's cleanup or "
                "`ckpt gc` finishes it)",
}


def _note(row: dict) -> str:
  """What the text of `ckpt ls` says of a row that is not committed."""
  if row["status"] == "incomplete":
    return row["problem"] or "not committed"
  if deletion.parse_name(row["name"]) is not None:
    return _STATUS_NOTE["deletion"]
  return _STATUS_NOTE[row["status"]]


def cmd_ls(args) -> int:
  storage = open_root(args, args.dir)
  with Progress(args, "sizing", unit="step") as bar:
    rows = list_entries(storage, bar, count_objects=args.objects)
  doc = {"directory": storage.url, "steps": rows}
  if not rows:
    emit(args, doc, f"no checkpoints in {args.dir}")
    return EXIT_OK
  lines = []
  for r in rows:
    if r["status"] == "committed":
      note = metrics_text(r.get("metrics"))
    elif r["status"] == "corrupt":
      note = r["error"]
    else:
      note = f"{r['name']}: {_note(r)}"
    files = "-" if r["files"] is None else str(r["files"])
    lines.append([str(r["step"]), r["status"], human_bytes(r["bytes"]),
                  files, local_time(r["time"]), note])
  text = table(["STEP", "STATUS", "SIZE", "FILES", "TIME", "METRICS"], lines,
               right=("STEP", "SIZE", "FILES"))
  ok = [r for r in rows if r["status"] == "committed"]
  summary = f"{len(ok)} committed"
  if ok:
    summary += f" (latest {ok[-1]['step']})"
  others = len(rows) - len(ok)
  if others:
    summary += f", {others} not committed or unreadable"
  if storage.is_posix:
    summary += f"; {human_bytes(sum(r['bytes'] for r in rows))} in all"
  emit(args, doc, f"{text}\n{summary}")
  return EXIT_OK


# ---- inspect -----------------------------------------------------------------

def leaf_info(e: index_lib.Entry) -> dict[str, Any]:
  from ckpt.format import tree  # pylint: disable=g-import-not-at-top
  name = tree.path_str(e.path)
  if isinstance(e, index_lib.ArrayEntry):
    grid = [math.ceil(s / c) if c else 0 for s, c in zip(e.shape, e.chunks)]
    return {"path": name, "kind": "array", "shape": list(e.shape),
            "dtype": e.dtype, "source_dtype": e.source_dtype,
            "bytes": convert.leaf_nbytes(e), "chunks": list(e.chunks),
            "chunk_count": math.prod(grid), "codec": e.codec,
            "sharding": e.sharding, "relpath": e.relpath,
            "checksums": len(getattr(e, "checksums", ())),
            **_prng_info(e, e.shape)}
  if isinstance(e, index_lib.PackedEntry):  # in the step's packs
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


def _prng_info(e: index_lib.Entry, shape) -> dict[str, Any]:
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
         "custom_metadata": index_lib.custom_metadata_of(index)}
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
  arrays = [e for e in index.leaves if isinstance(e, (index_lib.ArrayEntry, index_lib.PackedEntry))]
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
    steps = commit_lib.committed_steps(open_root(args, args.path))
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


# ---- gc ----------------------------------------------------------------------

def cmd_gc(args) -> int:
  if args.best_metric is not None and args.keep is None:
    raise UsageError("--best-metric needs --keep N (how many best to keep)")
  policy = RetentionPolicy(
      keep=args.keep, keep_period=args.keep_period,
      best_metric=args.best_metric, best_mode=args.best_mode,
      keep_checkpoints_without_metrics=args.keep_checkpoints_without_metrics)
  storage = open_root(args, args.dir)
  rows = list_entries(storage)
  by_name = {r["name"]: r for r in rows}
  committed = [r for r in rows if r["status"] in ("committed", "corrupt")]
  bad = [r for r in committed if r["status"] == "corrupt"]
  if bad and policy.best_metric is not None:
    raise CheckpointError(
        f"cannot rank by {policy.best_metric!r}: the index of step "
        f"{bad[0]['step']} is unreadable ({bad[0]['error']})")
  steps = [r["step"] for r in committed]
  metrics = {r["step"]: r.get("metrics", {}) for r in committed}
  doomed = policy.to_delete(steps, metrics)
  tmp = [r for r in rows if r["status"] == "uncommitted"]
  incomplete = [r for r in rows if r["status"] == "incomplete"]
  plan = []
  for s in doomed:
    r = by_name[storage_lib.step_dirname(s)]
    plan.append({"name": r["name"], "step": s, "kind": "step",
                 "bytes": r["bytes"], "reason": "retention policy"})
  skipped = []
  for r in tmp:
    age = r.get("age_s")
    item = {"name": r["name"], "step": r["step"], "kind": "uncommitted",
            "bytes": r["bytes"], "age_s": age}
    if args.tmp_min_age > 0 and (age is None or age < args.tmp_min_age):
      skipped.append({**item, "reason": f"last written {human_age(age)} ago; "
                      "may be a save in progress"})
    else:
      plan.append({**item, "reason": "abandoned save"})
  for r in incomplete:  # never without --incomplete: data may be recoverable
    item = {"name": r["name"], "step": r["step"], "kind": "incomplete",
            "bytes": r["bytes"], "problem": r["problem"]}
    if args.incomplete:
      plan.append({**item, "reason": f"incomplete: {r['problem']}"})
    else:
      skipped.append({**item, "reason": f"incomplete: {r['problem']}; "
                      "--incomplete deletes it"})
  deleted = []
  if args.yes:
    with Progress(args, "deleting", unit="dir") as bar:
      for i, item in enumerate(plan):
        if item["kind"] == "uncommitted":  # as it is now: never a new commit
          commit_lib.remove_abandoned(storage, item["name"])
        else:
          commit_lib.remove(storage, item["name"])
        deleted.append(item["name"])
        bar(i + 1, len(plan))
  kept = sorted(set(steps) - set(doomed))
  doc = {"directory": storage.url, "dry_run": not args.yes,
         "delete": plan, "deleted": deleted, "skipped": skipped,
         "kept": kept}
  verb = "deleted" if args.yes else "would delete"
  lines = []
  for item in plan:
    if item["kind"] == "step":
      what = f"step {item['step']}"
    elif item["kind"] == "incomplete":
      what = item["reason"]
    elif deletion.parse_name(item["name"]) is not None:
      what = "unfinished deletion"
    else:
      what = "abandoned save"
    lines.append(f"{verb} {item['name']} ({what}, "
                 f"{human_bytes(item['bytes'])})")
  for item in skipped:
    lines.append(f"kept {item['name']}: {item['reason']}" + (
        "" if item["kind"] == "incomplete" else
        f" (--tmp-min-age {args.tmp_min_age})"))
  lines.append(f"kept steps: {', '.join(map(str, kept)) or 'none'}")
  freed = sum(i["bytes"] or 0 for i in plan)
  if not plan:
    lines.append("nothing to delete")
  elif args.yes:
    lines.append(f"freed {human_bytes(freed)}")
  else:
    lines.append(f"dry run: nothing deleted ({human_bytes(freed)} would be "
                 "freed); pass --yes to delete")
  emit(args, doc, "\n".join(lines))
  return EXIT_OK


# ---- export / import ---------------------------------------------------------

def _some(names: list[str], n: int = 4) -> str:
  shown = ", ".join(names[:n])
  return shown + (f", ... ({len(names)} in all)" if len(names) > n else "")


def cmd_export(args) -> int:
  fmt = args.to
  if fmt is None:
    ext = os.path.splitext(args.out)[1].lstrip(".")
    if ext not in convert.FORMATS:
      raise UsageError(f"cannot tell the format from {args.out!r}; pass "
                       "--to safetensors or --to npz")
    fmt = ext
  with Progress(args, "export") as bar:
    report = convert.export(args.path, args.out, fmt, step=args.step,
                            storage_options=args.storage_options,
                            progress=bar)
  lines = [f"wrote {report.out}: step {report.step}, {report.tensors} "
           f"{'tensors' if fmt == 'safetensors' else 'arrays'}, "
           f"{human_bytes(report.bytes)}"]
  by_cast: dict[str, list[str]] = {}
  for path, cast in sorted(report.widened.items()):
    by_cast.setdefault(cast, []).append(path)
  for cast, paths in by_cast.items():
    lines.append(f"widened {len(paths)} leaves {cast} ({fmt} has no "
                 f"{cast.split('->')[0]}; exact): {_some(paths)}")
  if report.values and fmt == "safetensors":
    lines.append(f"{len(report.values)} non-array leaves kept in the header "
                 f"metadata ({convert.VALUES_KEY}): {_some(report.values)}")
  emit(args, report.to_json(), "\n".join(lines))
  return EXIT_OK


def _large_buffers_back_to_the_os() -> None:
  """glibc serves a large allocation from its heap once a freed one raised
  its mmap threshold, and keeps freed memory in per-thread arenas; the
  chunks TensorStore's threads decode are such buffers, so an import with
  a 16 MiB budget grew RSS by 130-170 MiB (200 MiB Orbax state). A fixed
  threshold (mallopt M_MMAP_THRESHOLD) maps every buffer of 1 MiB or more
  and unmaps it when freed: 55 MiB (scripts/import_memory.py). The same as
  MALLOC_MMAP_THRESHOLD_=1048576 in the environment; glibc only."""
  try:
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
  except (OSError, AttributeError):
    pass


def cmd_import(args) -> int:
  _large_buffers_back_to_the_os()
  options = {"format": args.format, "compression": args.compression}
  if args.concurrent_bytes is not None:
    options["concurrent_bytes"] = args.concurrent_bytes
  with Progress(args, "reading", unit="file") as bar:
    report = convert.import_checkpoint(
        args.src, args.dir, args.step, kind=args.source_kind, sep=args.sep,
        storage_options=args.storage_options,
        source_storage_options=args.source_storage_options,
        skip=args.skip or (), progress=bar, **options)
  kind = {"orbax": "Orbax checkpoint", "safetensors": "safetensors"}
  lines = [f"imported {report.leaves} leaves ({human_bytes(report.bytes)}) "
           f"from {kind[report.kind]} {report.source} as step {report.step} "
           f"of {report.directory}"]
  items = {k: v for k, v in report.items.items() if k}
  if items:
    lines.append("items: " + ", ".join(
        f"{name} ({what}{' -> step metrics' if what == 'metrics' else ''})"
        for name, what in items.items()))
  if report.skipped:
    lines.append(f"not imported (--skip): {', '.join(report.skipped)}")
  emit(args, report.to_json(), "\n".join(lines))
  return EXIT_OK


def _byte_size(text: str) -> int:
  """``1073741824``, ``64M``, ``1G`` (powers of 1024)."""
  units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
  t = text.strip().upper().removesuffix("IB").removesuffix("B")
  num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
  try:
    value = int(float(num) * units[unit])
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a size such as 64M or 1G, "
                                     f"got {text!r}") from None
  if value <= 0:
    raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
  return value


# ---- the parser and main -------------------------------------------------------

def _json_dict(text: str) -> dict:
  try:
    value = json.loads(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
  if not isinstance(value, dict):
    raise argparse.ArgumentTypeError("must be a JSON object")
  return value


def _non_negative(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}"
                                     ) from None
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def build_parser() -> argparse.ArgumentParser:
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--json", action="store_true",
                      help="print one JSON document on stdout")
  common.add_argument("-q", "--quiet", action="store_true",
                      help="no progress bar")
  common.add_argument("--storage-options", type=_json_dict, default=None,
                      metavar="JSON",
                      help="merged into the TensorStore kvstore spec, e.g. "
                      "'{\"endpoint\": \"http://127.0.0.1:9000\"}'")
  parser = argparse.ArgumentParser(
      prog="ckpt", description="Inspect, verify, clean up and convert ckpt "
      "checkpoints.", epilog="PATH may be a checkpoint root (with --step, "
      "default latest) or one checkpoint_<step> directory; any of them may "
      "be a path, file://, gs://, s3:// URL.")
  sub = parser.add_subparsers(dest="command", required=True,
                              metavar="COMMAND")

  p = sub.add_parser("ls", parents=[common],
                     help="list the steps of a checkpoint root")
  p.add_argument("dir", metavar="DIR")
  p.add_argument("--objects", action="store_true",
                 help="object stores: count each step's objects (FILES), "
                 "from a listing of every key of every step (a request per "
                 "1,000 keys); without it ls lists only the commit records")
  p.set_defaults(func=cmd_ls)

  p = sub.add_parser("inspect", parents=[common],
                     help="show one checkpoint's tree, shapes, dtypes, "
                     "chunking, codec and saved sharding")
  p.add_argument("path", metavar="PATH")
  p.add_argument("--step", type=_non_negative)
  p.set_defaults(func=cmd_inspect)

  p = sub.add_parser("verify", parents=[common],
                     help="read every stored byte and check its crc32c; "
                     "exit 1 if any leaf is corrupt")
  p.add_argument("path", metavar="PATH")
  p.add_argument("--step", type=_non_negative)
  p.add_argument("--all", action="store_true",
                 help="verify every committed step of the root PATH")
  p.set_defaults(func=cmd_verify)

  p = sub.add_parser("gc", parents=[common],
                     help="delete what a retention policy drops, and "
                     "abandoned saves (a dry run unless --yes)")
  p.add_argument("dir", metavar="DIR")
  p.add_argument("--keep", type=int, help="keep the newest N steps (or the "
                 "N best with --best-metric); the newest is always kept")
  p.add_argument("--keep-period", type=int, metavar="P",
                 help="never delete steps divisible by P")
  p.add_argument("--best-metric", metavar="M")
  p.add_argument("--best-mode", choices=("min", "max"), default="min")
  p.add_argument("--keep-checkpoints-without-metrics",
                 action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--tmp-min-age", type=_non_negative,
                 default=DEFAULT_TMP_MIN_AGE_S, metavar="SECONDS",
                 help="remove an uncommitted checkpoint_*.tmp-* directory "
                 "only if nothing in it changed for this long (default "
                 "%(default)s; it may be a save in progress)")
  p.add_argument("--incomplete", action="store_true",
                 help="also delete incomplete step directories (no commit "
                 "marker, or no index; on a disk only) and the ones a save "
                 "set aside (checkpoint_<step>.broken-*); never without "
                 "this flag: their data may be worth recovering")
  really = p.add_mutually_exclusive_group()
  really.add_argument("--yes", action="store_true", help="really delete")
  really.add_argument("--dry-run", action="store_true",
                      help="only say what would be deleted (the default)")
  p.set_defaults(func=cmd_gc)

  p = sub.add_parser("export", parents=[common],
                     help="write one checkpoint as a safetensors or npz file")
  p.add_argument("path", metavar="PATH")
  p.add_argument("out", metavar="OUT")
  p.add_argument("--to", choices=convert.FORMATS,
                 help="default: from OUT's extension")
  p.add_argument("--step", type=_non_negative)
  p.set_defaults(func=cmd_export)

  p = sub.add_parser("import", parents=[common],
                     help="save an Orbax checkpoint (every item) or "
                     "safetensors file(s) as a step of a ckpt root")
  p.add_argument("src", metavar="SRC")
  p.add_argument("dir", metavar="DIR")
  p.add_argument("--step", type=_non_negative, required=True)
  p.add_argument("--from", dest="source_kind", default="auto",
                 choices=("auto", "orbax", "safetensors"))
  p.add_argument("--sep", default="/",
                 help="safetensors keys are split on this into nested dicts "
                 "(default '/'; '' keeps them whole)")
  p.add_argument("--format", default="zarr", choices=("zarr", "zarr3", "ocdbt"))
  p.add_argument("--compression", choices=("zstd",))
  p.add_argument("--concurrent-bytes", type=_byte_size, metavar="SIZE",
                 help="host memory for data in flight (e.g. 256M; default "
                 "1G): Orbax leaves are read box by box within it")
  p.add_argument("--source-storage-options", type=_json_dict, default=None,
                 metavar="JSON", help="like --storage-options, for SRC")
  p.add_argument("--skip", action="append", metavar="NAME",
                 help="leave out this Orbax item (or 'metrics', "
                 "'custom_metadata'); repeatable. Without it, what ckpt "
                 "cannot import is refused by name")
  p.set_defaults(func=cmd_import)
  return parser


def _one_line(text: str, limit: int = 2000) -> str:
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _setup_libraries() -> int:
  """CPU only unless JAX_PLATFORMS says otherwise; library warnings (absl:
  ckpt's and Orbax's) off, since the command reports what matters itself.
  Returns the absl verbosity to put back."""
  if "JAX_PLATFORMS" not in os.environ:
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_platforms", "cpu")
  from absl import logging  # pylint: disable=g-import-not-at-top
  before = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  return before


@contextlib.contextmanager
def _native_stderr_quiet():
  """Native libraries log to file descriptor 2 on their own (TensorStore's
  AWS SDK prints nine lines while it looks for credentials, before ckpt's
  own one-line error). For the command's duration, fd 2 goes to an
  unlinked temporary file, and Python's ``sys.stderr`` (ckpt's messages,
  progress bars, tracebacks) to a copy of the real one. ``CKPT_DEBUG=1``
  keeps the native lines. Only when ``sys.stderr`` is the process's own:
  a program that captured it (pytest, a caller of ``main``) keeps its own."""
  try:
    fd = sys.stderr.fileno()
  except (AttributeError, OSError, ValueError):
    fd = None
  if (fd != 2 or sys.stderr is not sys.__stderr__ or
      os.environ.get("CKPT_DEBUG")):
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  py = os.fdopen(os.dup(saved), "w", buffering=1, encoding=sys.stderr.encoding,
                 errors="backslashreplace")
  with tempfile.TemporaryFile() as sink:
    os.dup2(sink.fileno(), 2)
    sys.stderr = py
    try:
      yield
    finally:
      py.flush()
      sys.stderr = sys.__stderr__
      os.dup2(saved, 2)
      os.close(saved)
      py.close()


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command; returns the exit status (console-script entry)."""
  with _native_stderr_quiet():
    return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
  args = build_parser().parse_args(argv)
  from absl import logging  # pylint: disable=g-import-not-at-top
  verbosity = logging.get_verbosity()
  try:
    verbosity = _setup_libraries()
    return args.func(args)
  except KeyboardInterrupt:
    print("ckpt: interrupted", file=sys.stderr)
    return 130
  except BrokenPipeError:  # `ckpt ls | head`: stop quietly
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # so the exit flush cannot fail
    return EXIT_OK
  except (CheckpointError, OSError, ValueError, TypeError) as e:
    if os.environ.get("CKPT_DEBUG"):
      raise
    message = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.filename and e.filename not in message:
      message = f"{e.filename}: {message}"
    print(f"ckpt: error: {_one_line(message)}", file=sys.stderr)
    return EXIT_FAIL
  except Exception as e:  # pylint: disable=broad-except
    if os.environ.get("CKPT_DEBUG"):
      raise
    print(f"ckpt: error: {type(e).__name__}: {_one_line(e)} (unexpected; "
          "CKPT_DEBUG=1 shows the traceback)", file=sys.stderr)
    return EXIT_FAIL
  finally:
    logging.set_verbosity(verbosity)  # main() may run inside a program
