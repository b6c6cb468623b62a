"""``ckpt ls``: every checkpoint_* entry of a root (committed, uncommitted, incomplete or
corrupt) with its size, file count, time and metrics, from the commit records and, on a disk,
the directories themselves; ``open_root`` opens a root for the subcommands that take one.
"""

from __future__ import annotations

import os
import time

from ckpt.commit import steps as steps_lib
from ckpt.commit.rename import RenameCommit
from ckpt.commit import cleanup as cleanup_lib
from ckpt.cli import convert
from ckpt.cli.usage import EXIT_OK, UsageError
from ckpt.commit import deletion
from ckpt.cli.output import (Progress, emit, human_bytes, iso_utc, local_time,
                             metrics_text, table)
from ckpt.restore import read as restore_lib
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError
from ckpt.store import names as names_lib


def open_root(args, directory: str) -> storage_lib.Storage:
  storage = storage_lib.Storage(directory, args.storage_options)
  if storage.is_posix:
    path = storage.spec["path"].rstrip("/") or "/"
    if not os.path.exists(path):
      raise CheckpointError(f"{directory} does not exist")
    if not os.path.isdir(path):
      raise CheckpointError(f"{directory} is not a directory")
  if storage.read_bytes(names_lib.INDEX_NAME) is not None:
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
  prefix = names_lib.STEP_PREFIX
  rng = ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))
  counts: dict[str, int] = {}
  for key in kv.list(rng).result():
    head = key.decode().partition("/")[0]
    counts[head] = counts.get(head, 0) + 1
  return counts


def _step_of(name: str) -> int:
  return steps_lib.step_of(name)


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
  committed = steps_lib.committed_steps(storage)
  rows: dict[str, dict] = {}
  for s in committed:
    name = names_lib.step_dirname(s)
    row = {"step": s, "name": name, "status": "committed"}
    try:
      index = restore_lib.read_index(storage, steps_lib.step_dir(storage, s))
      row.update(time=index.time, metrics=index.metrics,
                 temporary=index.temporary,
                 format=index.storage_format,
                 process_count=index.process_count, leaves=len(index.leaves),
                 data_bytes=sum(convert.leaf_nbytes(e) for e in index.leaves))
    except CheckpointError as e:
      row.update(status="corrupt", error=str(e))
    rows[name] = row
  for name in cleanup_lib.abandoned(storage, 0.0):  # every uncommitted attempt
    rows[name] = {"step": _step_of(name), "name": name,
                  "status": "uncommitted"}
  if storage.is_posix:
    # Directories of a disk by name (set-aside ones too): a question of the
    # rename kind alone, not of CommitKind, so it is asked of that kind.
    disk = RenameCommit(storage)
    for p in os.listdir(storage.spec["path"]):
      if not os.path.isdir(os.path.join(storage.spec["path"], p)):
        continue  # a file named checkpoint_<n> is not ckpt's
      s = names_lib.parse_step(p)
      aside = names_lib.parse_broken(p)
      if s is not None and p not in rows:
        rows[p] = {"step": s, "name": p, "status": "incomplete",
                   "problem": disk.problem(p)}
      elif aside is not None:
        problem = disk.problem(p)
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
      note = " ".join(x for x in ("temporary" if r.get("temporary") else "",
                                  metrics_text(r.get("metrics"))) if x)
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
