"""The per-process items of an Orbax step, imported as each process's
``host_state`` (ckpt/cli/orbax_import.py reads the rest of the step).

An Orbax job of M processes keeps per-process state (a data loader's
position) in one of two layouts, both read here:

- Grain's: one item whose directory holds ``process_<i>-of-<M>.json`` for
  every i in [0, M) (grain's ``PyGrainCheckpointHandler`` /
  ``CheckpointHandler`` write the iterator's JSON state so; so does a
  ``JsonCheckpointHandler`` given that file name). Recognised by its files,
  whatever handler wrote it.
- JSON items named per process: ``JsonSave`` items whose names end in
  ``process_<i>-of-<M>`` (``loader_process_0-of-2``, ``loader_process_1-of-2``),
  one per process; their common prefix (``loader``, without the separator)
  names the group.

The imported step's host_state for process i is the JSON value of process
i's file when the step has one such item (or group), or ``{name: value}``
over them when it has several; every one must be of the same M, with every
process's file present. ``ckpt import`` saves them with
``host_state=EveryProcess(values)`` (ckpt/format/extras.py): one host_state
file per source process, so that a job of M processes reads back its own
(``host_state(step)``). A step without per-process items holds no
host_state: ``host_state(step)`` is None on any number of processes.

The files are untrusted input like the rest (ckpt/cli/orbax_bounds.py): a
process number comes from a file or item name matched whole by the
patterns below, never used as a path (the file read is the listed one);
each file is at most index.MAX_PROCESS_FILE_BYTES, nests at most
MAX_JSON_DEPTH deep, must pack as msgpack, and all of them together pack
into at most MAX_TOTAL_BYTES.
"""

from __future__ import annotations

import re
from typing import Any

from ckpt.cli import orbax_bounds
from ckpt.cli.orbax_tree import list_files, read_json
from ckpt.errors import OrbaxImportError
from ckpt.errors import InvalidStateError
from ckpt.format import extras as save_extras
from ckpt.format import index as index_lib

# Files in an item directory that are not the item's data.
NOT_DATA = ("commit_success.txt",)
_NUMBER = "(0|[1-9][0-9]{0,6})"  # no leading zeros: one name per process
PROCESS_FILE = re.compile(f"process_{_NUMBER}-of-{_NUMBER}\\.json")
PROCESS_ITEM = re.compile(f"(.*?)[._-]?process_{_NUMBER}-of-{_NUMBER}")
# All the per-process values of a step, packed (the importer holds them).
MAX_TOTAL_BYTES = 256 << 20


def data_files(storage, name: str) -> list[str]:
  """The files of item ``name``, relative to its directory, without
  Orbax's commit marker."""
  return [f for f in list_files(storage, f"{name}/") if f not in NOT_DATA]


def grain_files(storage, name: str) -> dict[int, str] | None:
  """{process: file key} when every data file of item ``name`` is a
  ``process_<i>-of-<n>.json`` (Grain's layout), else None."""
  files = data_files(storage, name)
  found = [(f, PROCESS_FILE.fullmatch(f)) for f in files]
  if not files or not all(m for _, m in found):
    return None
  where = f"{storage.url.rstrip('/')}/{name}"
  return _complete({int(m[1]): (int(m[2]), f"{name}/{f}") for f, m in found},
                   where, "files")


def item_process(name: str) -> tuple[str, int, int] | None:
  """(group, process, count) of a JSON item named per process, or None."""
  m = PROCESS_ITEM.fullmatch(name)
  return (m[1] or "process", int(m[2]), int(m[3])) if m else None


def json_group(storage, names: dict[int, str]) -> dict[int, str]:
  """{process: file key} of a group of JSON items named per process
  ({process: item name}); each item holds one file."""
  where = storage.url.rstrip("/")
  keys = {}
  for i, name in names.items():
    files = data_files(storage, name)
    if len(files) != 1:
      raise OrbaxImportError(f"{where}/{name}: a JSON item should hold one "
                             f"file, found {files[:5]}")
    keys[i] = (item_process(name)[2], f"{name}/{files[0]}")
  return _complete(keys, f"{where}/{sorted(names.values())[0]}", "items")


def _complete(found: dict[int, tuple[int, str]], where: str, what: str
              ) -> dict[int, str]:
  counts = sorted({n for n, _ in found.values()})
  if len(counts) != 1 or not 0 < counts[0] <= index_lib.MAX_PROCESSES:
    raise OrbaxImportError(
        f"{where}: per-process {what} of process counts {counts[:5]}; "
        "expected one count, at least 1")
  missing = sorted(set(range(counts[0])) - set(found))[:5]
  if missing or len(found) != counts[0]:
    raise OrbaxImportError(
        f"{where}: per-process {what} for {counts[0]} processes, but those "
        f"of processes {missing} are missing (found {sorted(found)[:5]}...)"
        "; an incomplete Orbax step")
  return {i: rel for i, (_, rel) in found.items()}


def host_states(storage, groups: dict[str, dict[int, str]]) -> list[Any]:
  """Each source process's host_state from the per-process items
  (``groups``: {item or group name: {process: file key}}): the value of its
  file, or {name: value} when there are several items."""
  url = storage.url.rstrip("/")
  counts = {name: len(files) for name, files in groups.items()}
  if len(set(counts.values())) != 1:
    raise OrbaxImportError(
        f"{url}: its per-process items were saved by different numbers of "
        f"processes ({dict(sorted(counts.items()))}); expected one job's")
  total, out = 0, [{} for _ in range(next(iter(counts.values())))]
  for name, files in sorted(groups.items()):
    for i, rel in sorted(files.items()):
      where = f"{url}/{rel}"
      value = read_json(storage, rel, f"the host_state of process {i}",
                        limit=index_lib.MAX_PROCESS_FILE_BYTES)
      orbax_bounds.json_depth(value, where)
      try:
        total += len(save_extras.pack_host_state(value))
      except InvalidStateError as e:
        raise OrbaxImportError(f"{where}: {e}") from None
      if total > MAX_TOTAL_BYTES:
        raise OrbaxImportError(
            f"{url}: its per-process items pack into more than "
            f"{MAX_TOTAL_BYTES} bytes (at {where}); refusing them")
      out[i][name] = value
  if len(groups) == 1:
    return [next(iter(v.values())) for v in out]
  return out
