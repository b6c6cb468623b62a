"""What a step holds for later ones: the marking of retention and cleanup.

On a bucket, ``reuse_unchanged=True`` saves a leaf that did not change as
a reference: the new step's index says ``held_by: [S, "attempt-<hex>"]``
and the array stays in step S's data directory (ckpt/save/reuse_held.py).
Deleting S (retention, ``delete``, ``ckpt gc``, cleanup finishing a
deletion that died) must then leave those arrays in place: ``marks`` reads
the indexes of the committed steps after S and of the saves in flight
(their ``pending/`` records: a save refers only to a step committed when
it began, and checks after its own commit that the step it found its
references through is still committed, so a deletion that removed S's
record before that check marks from its index) and names the arrays
(relative paths) they hold there. ``deletion._drop`` deletes everything
else of S's data directory, keeping those arrays and the ``.reuse`` files
(which say that S may hold data for others). When a step that referred to
S goes, ``sweep`` marks again and removes what nobody refers to any more,
S's ``.reuse`` files last of all once nothing is left.

Any index that cannot be read while marking (damaged, over the limits)
keeps all of S: a leak, never a loss. A kill at any moment leaves at worst
unreferenced data behind (the deletion's ``pending/`` record is dropped
last, so cleanup finishes it, sweep included: the deleted step's index is
removed after its sweep). The cost, only for a step saved with reuse on a
bucket: one listing of ``commits/`` and of ``pending/``, and one index
read per newer step, per deletion.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from absl import logging

from ckpt.commit import attempt
from ckpt.commit import records
from ckpt.errors import CheckpointError
from ckpt.format import entries
from ckpt.format import index as index_lib
from ckpt.store import names
from ckpt.store import storage as storage_lib

KEEP_ALL = None  # ``marks``: nobody can say what is unreferenced


def _flag(data_dir: str) -> str:
  """The key whose presence says a data directory may hold data for
  later steps: its process 0's ``.reuse`` file (only reuse saves write it)."""
  return index_lib.process_file(index_lib.REUSE_DIR, 0, data_dir)


def _index_of(storage: storage_lib.Storage, data_dir: str
              ) -> index_lib.Index | None:
  """The index in ``data_dir`` (None: there is none); raises if damaged."""
  data = storage.read_bytes(storage.index_key(data_dir),
                            limit=index_lib.MAX_INDEX_BYTES)
  if data is None:
    return None
  return index_lib.decode(data, f"{storage.url.rstrip('/')}/{data_dir}")


def _later_dirs(storage: storage_lib.Storage, step: int) -> list[str]:
  """The data directories of the committed steps after ``step`` and of the
  saves in flight after it (their attempts)."""
  out = []
  for key in storage.list_keys(records.RECORDS):
    name = key[len(records.RECORDS):]
    if not records.STEP_NAME_RE.match(name) or int(name) <= step:
      continue
    rec = records.read_record(storage, int(name))
    if rec is not None and rec["dir"]:
      out.append(f"{names.step_dirname(int(name))}/{rec['dir']}")
  for s, token in records.list_pending(storage):
    if s > step and token != records.DELETE:
      out.append(f"{names.step_dirname(s)}/{attempt.ATTEMPT_PREFIX}{token}")
  return out


def marks(storage: storage_lib.Storage, step: int, data_dir: str
          ) -> set[str] | None:
  """The arrays (relative paths) of ``checkpoint_<step>/<data_dir>`` that
  a committed step after it, or a save in flight, holds there; KEEP_ALL
  when an index could not be read. Empty for a directory no reuse save
  wrote (one request)."""
  if storage.is_posix or not records.ATTEMPT_DIR_RE.match(data_dir):
    return set()
  where = f"{names.step_dirname(step)}/{data_dir}"
  if not storage.exists(_flag(where)):
    return set()
  target, out = (step, data_dir), set()
  for d in _later_dirs(storage, step):
    try:
      index = _index_of(storage, d)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("ckpt: keeping all of step %d's data in %s: the index "
                      "in %s cannot be read (%s)", step, storage.url, d, e)
      return KEEP_ALL
    for e in (index.leaves if index is not None else ()):
      if getattr(e, "held_by", None) == target:
        out.add(e.relpath)
  return out


def kept(keys: list[str], where: str, held: set[str] | None) -> list[str]:
  """Of ``keys`` under ``where/``, those to delete: all but the arrays in
  ``held`` and, while anything is held, the ``.reuse`` files."""
  if held is KEEP_ALL:
    return []
  if not held:
    return keys
  keep = tuple(f"{where}/{r}/" for r in held) + (
      f"{where}/{index_lib.REUSE_DIR}/",)
  return [k for k in keys if not k.startswith(keep)]


def referred(storage: storage_lib.Storage, data_dir: str
             ) -> set[tuple[int, str]]:
  """The (step, data directory) pairs the index in ``data_dir`` refers to
  (none if it has no index or cannot be read: nothing is swept then)."""
  try:
    index = _index_of(storage, data_dir)
  except Exception:  # pylint: disable=broad-except
    return set()
  return set() if index is None else referred_by(index)


def sweep(storage: storage_lib.Storage, targets: set[tuple[int, str]]
          ) -> None:
  """After a step referring to ``targets`` was deleted: removes from each
  target that is no longer a committed step what nobody refers to now."""
  for step, data_dir in sorted(targets):
    rec = records.read_record(storage, step)
    if rec is not None and rec["dir"] == data_dir:
      continue  # still a step: its own deletion marks
    where = f"{names.step_dirname(step)}/{data_dir}"
    held = marks(storage, step, data_dir)
    storage.delete_keys(kept(storage.list_keys(f"{where}/"), where, held),
                        f"step {step}'s unreferenced data")


def detach(storage: storage_lib.Storage, step: int,
           verify: Callable[[], list]) -> dict[int, int]:
  """Makes the committed ``step`` of a bucket self-contained (``ckpt
  detach``): copies every array it holds by reference into its own data
  directory, then rewrites its index without ``held_by`` (one PUT: a
  reader sees the old index, reading the holder, or the new one, reading
  the copy), then sweeps what nobody refers to any more. Returns {holder
  step: bytes copied}.

  Nothing damaged is copied: the generation of every object to copy is
  taken, then ``verify()`` (the step's problems, checked against its
  crc32c records: ``ckpt verify``) must find none, and each object copied
  must still have that generation. Else it raises, having removed the
  copies it made: the index, the holder and the step are as they were."""
  if storage.is_posix:
    raise CheckpointError(
        f"{storage.url!r} is a disk: reuse there hard-links (each step is "
        "whole already); a bucket's root copied to a disk is detached on a "
        "bucket")
  rec = records.read_record(storage, step)
  if rec is None or not rec["dir"]:
    raise CheckpointError(f"step {step} of {storage.url!r} is not a "
                          "committed step of a bucket")
  where = f"{names.step_dirname(step)}/{rec['dir']}"
  index = _index_of(storage, where)
  if index is None:
    raise CheckpointError(f"step {step} of {storage.url!r} has no index")
  todo = []  # (entry, holder, {key: generation})
  for e in index.leaves:
    ref = getattr(e, "held_by", None)
    if ref is None:
      continue
    src = f"{entries.held_dir(ref)}/{e.relpath}/"
    keys = storage.list_keys(src)
    if not keys:
      raise CheckpointError(
          f"leaf {e.relpath!r} of step {step} is held by step {ref[0]}, "
          f"which holds nothing under {src!r}: it cannot be restored")
    todo.append((e, ref, {k: storage.generation(k) for k in keys}))
  if not todo:
    return {}
  if problems := verify():
    raise CheckpointError(
        f"step {step} of {storage.url!r} fails verification, so it is not "
        "detached (nothing was changed): " + "; ".join(
            getattr(p, "message", str(p)) for p in problems))
  copied: dict[int, int] = {}
  made: list[str] = []
  try:
    for e, ref, gens in todo:
      src = f"{entries.held_dir(ref)}/{e.relpath}/"
      for k, gen in sorted(gens.items()):
        data, now = storage.read_generation(k)
        if data is None or now != gen:
          raise CheckpointError(
              f"{storage.url.rstrip('/')}/{k} (leaf {e.relpath!r}, held by "
              f"step {ref[0]}) {'disappeared' if data is None else 'changed'} "
              f"after step {step} was verified: not detached, nothing was "
              "changed")
        made.append(f"{where}/{e.relpath}/{k[len(src):]}")
        storage.write_bytes(made[-1], data)
        copied[ref[0]] = copied.get(ref[0], 0) + len(data)
  except BaseException:
    storage.delete_keys(made, f"the copies detaching step {step} made")
    raise
  leaves = [dataclasses.replace(e, held_by=None)
            if getattr(e, "held_by", None) is not None else e
            for e in index.leaves]
  if copied:
    storage.write_bytes(storage.index_key(where), index_lib.encode(
        dataclasses.replace(index, leaves=tuple(leaves))))
    sweep(storage, referred_by(index))
  return copied


def referred_by(index: index_lib.Index) -> set[tuple[int, str]]:
  return {e.held_by for e in index.leaves
          if getattr(e, "held_by", None) is not None}
