"""``ckpt export``: one checkpoint written as one safetensors or npz file (the format rules
are in ckpt/cli/convert.py's docstring), streamed a leaf at a time through the same lazy leaves
that restore uses, with the dtypes a format cannot hold widened exactly and the non-array
leaves kept (safetensors: in the header's metadata; npz: as 0-d arrays).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zipfile
from typing import Any

import numpy as np

from ckpt.cli.convert import (VALUES_KEY, ConvertError, Progress, encode_py,
                              iter_leaves, open_checkpoint)
from ckpt.format import index as index_lib
from ckpt.format import tree
from ckpt.format import checks
from ckpt.format import entries
from ckpt.format import pack_index
from ckpt.hf.header import ST_CODES, ST_DTYPES, ST_WIDEN, header_bytes

FORMATS = ("safetensors", "npz")
# Exact widenings for dtypes a format cannot hold.
_NPZ_WIDEN = {"int4": "int8", "bfloat16": "float32",
              **{n: "float32" for n in checks.ALLOWED_DTYPES
                 if n.startswith("float8")}}


@dataclasses.dataclass
class ExportReport:
  out: str
  format: str
  step: int
  tensors: int = 0
  bytes: int = 0
  widened: dict[str, str] = dataclasses.field(default_factory=dict)
  values: list[str] = dataclasses.field(default_factory=list)

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def export(path, out, fmt: str, *, step: int | None = None,
           storage_options: dict | None = None,
           progress: Progress | None = None) -> ExportReport:
  """Writes one checkpoint as one ``fmt`` file at ``out`` (atomically)."""
  if fmt not in FORMATS:
    raise ConvertError(f"export format must be one of {FORMATS}, got {fmt!r}")
  storage, step_dir, index = open_checkpoint(path, step, storage_options)
  out = os.fspath(out)
  report = ExportReport(out=out, format=fmt, step=index.step)
  partial = out + ".partial"
  leaves = iter_leaves(storage, step_dir, index, progress)
  try:
    if fmt == "safetensors":
      _export_safetensors(index, leaves, partial, report)
    else:
      _export_npz(leaves, partial, report)
    os.replace(partial, out)
  finally:
    if os.path.exists(partial):
      os.remove(partial)
  report.bytes = os.path.getsize(out)
  return report


def _widened(name: str, dtype: np.dtype, table: dict[str, str],
             report: ExportReport) -> np.dtype:
  if dtype.name in table:
    report.widened[name] = f"{dtype.name}->{table[dtype.name]}"
    return np.dtype(table[dtype.name])
  return dtype


def _is_py_value(entry: entries.Entry) -> bool:
  return isinstance(entry, entries.ValueEntry) and not isinstance(
      entry.value, (np.ndarray, np.generic))


def _le_bytes(arr: np.ndarray) -> np.ndarray:
  """The array's bytes, little-endian and C-ordered, as a flat uint8 view."""
  if arr.dtype.byteorder == ">":
    arr = arr.astype(arr.dtype.newbyteorder("<"))
  return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def _export_safetensors(index: index_lib.Index, leaves, out: str,
                        report: ExportReport) -> None:
  # Everything the header says (shapes, dtypes, offsets, inline values) is
  # in the index, so the header is written first and the data then streams
  # leaf by leaf.
  header: dict[str, Any] = {}
  values: dict[str, Any] = {}
  offset = 0
  for e in index.leaves:
    name = tree.path_str(e.path)
    if _is_py_value(e):
      values[name] = encode_py(name, e.value)
      continue
    if isinstance(e, (entries.ArrayEntry, pack_index.PackedEntry)):
      shape, dtype = e.shape, np.dtype(e.dtype)
    else:
      shape, dtype = e.value.shape, e.value.dtype
    dtype = _widened(name, dtype, ST_WIDEN, report)
    if dtype.name not in ST_CODES:
      raise ConvertError(
          f"leaf {name!r} has dtype {dtype.name}, which safetensors cannot "
          "hold; export it to npz instead")
    n = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": ST_CODES[dtype.name], "shape": list(shape),
                    "data_offsets": [offset, offset + n]}
    offset += n
  meta = {"ckpt.step": str(index.step)}
  if values:
    meta[VALUES_KEY] = json.dumps(values, sort_keys=True)
  report.values = sorted(values)
  with open(out, "wb") as f:
    f.write(header_bytes(header, meta))
    for name, value in leaves:
      spec = header.get(name)
      if spec is None:
        continue
      arr = np.asarray(value).astype(ST_DTYPES[spec["dtype"]], copy=False)
      begin, end = spec["data_offsets"]
      if arr.nbytes != end - begin:
        raise ConvertError(f"leaf {name!r}: read {arr.nbytes} bytes, the "
                           f"index says {end - begin}")
      f.write(_le_bytes(arr))
      report.tensors += 1


def _export_npz(leaves, out: str, report: ExportReport) -> None:
  with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
    for name, value in leaves:
      if not isinstance(value, (np.ndarray, np.generic)):
        report.values.append(name)
      arr = np.asarray(value)
      arr = arr.astype(_widened(name, arr.dtype, _NPZ_WIDEN, report),
                       copy=False)
      if arr.dtype.hasobject:
        raise ConvertError(f"leaf {name!r}: {type(value).__name__} cannot "
                           "be stored in npz without pickle")
      with zf.open(name + ".npy", "w", force_zip64=True) as f:
        np.lib.format.write_array(f, arr, allow_pickle=False)
      report.tensors += 1
