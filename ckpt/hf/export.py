"""``export_safetensors``: one saved step written as a Hub-ready set.

The set is ``model-00001-of-0000N.safetensors`` shards of at most
``max_shard_bytes`` each (a tensor larger than that alone in its shard) and
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``),
which ``transformers`` and the ``safetensors`` library open.

Names go back through ``names`` reversed (ckpt/hf/names.py): a leaf that a
rule ``...[i]`` stacked is written as one tensor per index of its leading
axis, one that ``.T`` transposed is transposed back. Dtypes stay (bf16 is
BF16); int4 and float8_e4m3b11fnuz, which safetensors lacks, are widened
exactly (ckpt/hf/header.py ``ST_WIDEN``). With ``names`` given, a leaf no
rule reaches (optimizer state, a step counter) is left out and listed in the
report's ``skipped``; python values (not arrays) are always left out.

Memory: the step is read through the same lazy leaves a restore uses, one
output slice at a time (rows of the tensor written, at most
``SLICE_BYTES``), each written before the next is read: a slice, its cast
and its transposed copy, never a whole leaf. On a disk each shard streams
into a ``.partial`` file renamed into place once every shard is written
(the index JSON last); on a bucket (``gs://``, ``s3://``) a shard is one
object written whole, so host memory holds one shard there (pick
``max_shard_bytes`` to fit). An existing set in ``out_dir`` is refused,
never overwritten.

Reads are not checked against the step's checksums (as ``ckpt export``'s):
a checked read holds each recorded box (a device's shard) whole, which is
more than a slice; run ``ckpt verify`` on the step first.

Run it on one process (``ckpt export`` or a script); to export from a
multi-process job, save a step and export it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterator

import numpy as np

from ckpt.errors import CheckpointError
from ckpt.format import tree
from ckpt.hf import files as files_lib
from ckpt.hf import header as header_lib
from ckpt.hf import names as names_lib
from ckpt.restore import lazy
from ckpt.restore import read as read_lib
from ckpt.restore.tasks import run_sync
from ckpt.shards.plan import Box
from ckpt.store import storage as storage_lib

SLICE_BYTES = 64 << 20


@dataclasses.dataclass
class ExportReport:
  """What ``export_safetensors`` wrote."""
  out_dir: str
  step: int
  files: list[str] = dataclasses.field(default_factory=list)
  tensors: int = 0
  total_size: int = 0
  widened: dict[str, str] = dataclasses.field(default_factory=dict)
  skipped: list[str] = dataclasses.field(default_factory=list)

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Out:
  """One tensor to write: ``leaf`` (at ``index`` of its leading axis),
  transposed or not, as ``dtype``."""
  key: str
  leaf: Any
  index: int | None
  transpose: bool
  shape: tuple[int, ...]
  dtype: np.dtype

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def _places(rules: names_lib.Names, path: str, shape: tuple[int, ...]
            ) -> list[tuple[str, names_lib.Place]]:
  """(key, place) of every tensor leaf ``path`` is written as; [] if no
  rule reaches it."""
  for transpose in (False, True):
    place = names_lib.Place(path, None, transpose)
    key = rules.key_of(place.text())
    if key is not None:
      return [(key, place)]
  if not shape:
    return []
  for transpose in (False, True):
    first = names_lib.Place(path, 0, transpose)
    if rules.key_of(first.text()) is None:
      continue
    out = []
    for i in range(shape[0]):
      place = names_lib.Place(path, i, transpose)
      key = rules.key_of(place.text())
      if key is None:
        raise names_lib.NotReversible(
            f"names places a key at {first.text()!r} but none at "
            f"{place.text()!r}; leaf {path!r} has {shape[0]} entries on its "
            "leading axis")
      out.append((key, place))
    return out
  return []


def _plan(index, leaves: dict, rules: names_lib.Names,
          report: ExportReport) -> list[_Out]:
  outs, seen = [], {}
  for e in index.leaves:
    path = tree.path_str(e.path)
    leaf = leaves[e.path]
    if not isinstance(leaf, lazy.LazyLeaf):
      report.skipped.append(path)
      continue
    dtype = np.dtype(leaf.dtype)
    if dtype.name in header_lib.ST_WIDEN:
      report.widened[path] = f"{dtype.name}->{header_lib.ST_WIDEN[dtype.name]}"
      dtype = np.dtype(header_lib.ST_WIDEN[dtype.name])
    if dtype.name not in header_lib.ST_CODES:
      raise CheckpointError(f"leaf {path!r} has dtype {dtype.name}, which "
                            "safetensors cannot hold")
    shape = tuple(leaf.shape)
    places = _places(rules, path, shape)
    if not places:
      report.skipped.append(path)
    for key, place in places:
      if key in seen:
        raise names_lib.NotReversible(
            f"names writes {key!r} for both {seen[key]!r} and "
            f"{place.text()!r}")
      seen[key] = place.text()
      one = shape if place.index is None else shape[1:]
      if place.transpose:
        one = tuple(reversed(one))
      outs.append(_Out(key, leaf, place.index, place.transpose, one, dtype))
  return outs


def _shards(outs: list[_Out], max_bytes: int) -> list[list[_Out]]:
  shards, cur, used = [], [], 0
  for o in outs:
    if cur and used + o.nbytes > max_bytes:
      shards.append(cur)
      cur, used = [], 0
    cur.append(o)
    used += o.nbytes
  if cur or not shards:
    shards.append(cur)
  return shards


def _slices(o: _Out) -> Iterator[np.ndarray]:
  """The tensor's data in row blocks (of its own first axis), each read
  from the leaf as the box it needs, at most SLICE_BYTES."""
  inner = tuple(reversed(o.shape)) if o.transpose else o.shape
  lead = () if o.index is None else (o.index,)
  if not o.shape:
    box = Box(lead, tuple(i + 1 for i in lead))
    yield np.asarray(run_sync(o.leaf.read_box(box))).reshape(())
    return
  row = max(1, math.prod(o.shape[1:]) * o.dtype.itemsize)
  step = max(1, SLICE_BYTES // row)
  for a in range(0, o.shape[0], step):
    b = min(o.shape[0], a + step)
    if o.transpose:  # rows of the output: the last axis of the leaf's
      start = (0,) * (len(inner) - 1) + (a,)
      stop = inner[:-1] + (b,)
    else:
      start = (a,) + (0,) * (len(inner) - 1)
      stop = (b,) + inner[1:]
    box = Box(lead + start, tuple(i + 1 for i in lead) + stop)
    data = np.asarray(run_sync(o.leaf.read_box(box)))
    if lead:
      data = data[0]
    yield data.T if o.transpose else data


def _le_bytes(arr: np.ndarray, dtype: np.dtype) -> memoryview:
  arr = np.ascontiguousarray(arr.astype(dtype.newbyteorder("<"), copy=False))
  return memoryview(arr.reshape(-1).view(np.uint8))


class _Writer:
  """Shards into ``out_dir``: streamed files on a disk, whole objects on a
  bucket."""

  def __init__(self, out_dir: str):
    self.storage = storage_lib.Storage(out_dir)
    if self.storage.is_posix:
      self.root = os.fspath(self.storage.root)
      os.makedirs(self.root, exist_ok=True)
      taken = [n for n in os.listdir(self.root)
               if n.endswith(".safetensors") or n == files_lib.INDEX_NAME]
    else:
      taken = [n for n in self.storage.list_all()
               if n.endswith(".safetensors") or n == files_lib.INDEX_NAME]
    if taken:
      raise CheckpointError(
          f"{out_dir} already holds {sorted(taken)[:5]}; export into an "
          "empty directory (nothing is overwritten)")
    self.partial: list[tuple[str, str]] = []

  def write(self, name: str, chunks: Iterator[bytes]) -> None:
    if not self.storage.is_posix:
      data = bytearray()
      for c in chunks:
        data += c
      self.storage.write_bytes(name, bytes(data))
      return
    tmp = os.path.join(self.root, name + ".partial")
    with open(tmp, "wb") as f:
      for c in chunks:
        f.write(c)
      f.flush()
      os.fsync(f.fileno())
    self.partial.append((tmp, os.path.join(self.root, name)))

  def commit(self) -> None:
    for tmp, final in self.partial:
      os.replace(tmp, final)
    self.partial = []

  def abort(self) -> None:
    for tmp, _ in self.partial:
      if os.path.exists(tmp):
        os.remove(tmp)


def _shard_bytes(shard: list[_Out], meta: dict[str, str]) -> Iterator[bytes]:
  head, offset = {}, 0
  for o in shard:
    head[o.key] = {"dtype": header_lib.ST_CODES[o.dtype.name],
                   "shape": list(o.shape),
                   "data_offsets": [offset, offset + o.nbytes]}
    offset += o.nbytes
  yield header_lib.header_bytes(head, meta)
  for o in shard:
    for data in _slices(o):
      yield _le_bytes(data, o.dtype)


def export_safetensors(path, out_dir, *, step: int | None = None,
                       names: Any = None,
                       max_shard_bytes: int = 5 << 30) -> ExportReport:
  """Writes a saved step as safetensors shards and their index JSON.

  Args:
    path: a checkpoint root (then ``step``, default latest) or one step.
    out_dir: the directory to write (a path or a ``gs://`` / ``s3://``
      URL); it must hold no safetensors set yet.
    step: the committed step of a root to export.
    names: the ``names`` of ``load_safetensors``, reversed (a dict or
      regex pairs; a function cannot be reversed). None: keys are leaf paths.
    max_shard_bytes: the most data bytes of one shard.

  Returns:
    An ExportReport (files written, tensors, total_size, widened and
    skipped leaves).

  Raises:
    CheckpointNotFoundError: no such committed step.
    CheckpointError: ``out_dir`` already holds a set, or a leaf of a dtype
      safetensors cannot hold.
    TreeMismatchError: ``names`` that cannot be reversed (a function, a
      regex of more than literal text and groups, two keys for one path).

  Not collective: run it on one process.
  """
  if max_shard_bytes <= 0:
    raise ValueError(f"max_shard_bytes must be positive, got "
                     f"{max_shard_bytes}")
  storage = storage_lib.Storage(path)
  step_dir = read_lib.locate_path(storage, step)
  index = read_lib.read_index(storage, step_dir)
  leaves = read_lib.step_leaves(index, storage, step_dir, storage.context(),
                                lazy.DEFAULT_READ_BUDGET)
  report = ExportReport(out_dir=os.fspath(out_dir), step=index.step)
  outs = _plan(index, leaves, names_lib.Names(names), report)
  shards = _shards(outs, max_shard_bytes)
  n = len(shards)
  writer = _Writer(os.fspath(out_dir))
  weight_map: dict[str, str] = {}
  try:
    for i, shard in enumerate(shards):
      name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
      writer.write(name, _shard_bytes(shard, {"format": "pt"}))
      report.files.append(name)
      for o in shard:
        weight_map[o.key] = name
        report.tensors += 1
        report.total_size += o.nbytes
    writer.commit()
  except BaseException:
    writer.abort()
    raise
  doc = {"metadata": {"total_size": report.total_size},
         "weight_map": dict(sorted(weight_map.items()))}
  writer.storage.write_bytes(files_lib.INDEX_NAME,
                             json.dumps(doc, indent=2).encode())
  return report
