"""A safetensors header, parsed as untrusted input.

A safetensors file is 8 bytes (the header's length N, little-endian), N
bytes of JSON (``{key: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}``, offsets relative to the data after the
header), then the data. Whatever a file says, parsing it is bounded (docs/
untrusted.md's rules, docs/huggingface.md "Untrusted files"):

- N is at most ``MAX_HEADER_BYTES`` (16 MiB; a real header takes about 150
  bytes a tensor, under 1 MiB for the largest shards published) and is
  checked before the header is read; a longer one is refused unread.
- Before ``json.loads``, the JSON is counted: past 64 Ki of each, at most
  one container (``[`` or ``{``) per 16 bytes and one string per 12 (a
  real header has about 3 containers and 5 strings per tensor entry of
  60-150 bytes), so decoding the largest header allowed costs at most about
  150 MB and 2 s (measured on 16 MiB of the densest lists and of strings:
  145 MB, 1.8 s and 103 MB, 0.2 s). Nesting deeper than Python's recursion
  limit, duplicate keys and non-JSON are refused.
- Each entry: a known dtype string, a shape of at most ``MAX_RANK`` non-
  negative ints, offsets ``[begin, end]`` with ``end - begin`` equal to the
  shape's bytes (python ints: no overflow, so a header claiming 2^40
  elements needs 2^40 elements' bytes in the file), and no two tensors
  overlapping. That the file holds ``data_end`` bytes of data is checked
  where the file is read (ckpt/hf/files.py: one ranged read of the last
  byte claimed).

Every error is a CorruptCheckpointError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16, float8)
import numpy as np

from ckpt.errors import CorruptCheckpointError

MAX_HEADER_BYTES = 16 << 20
MAX_RANK = 32
# Bytes of header per container and per string, at least (the docstring).
_BYTES_PER_CONTAINER = 16
_BYTES_PER_STRING = 12
_SLACK = 1 << 16  # small headers (short names) are never refused by count

# numpy dtype name <-> safetensors dtype code.
ST_CODES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16",
    "int16": "I16", "uint32": "U32", "int32": "I32", "uint64": "U64",
    "int64": "I64", "float16": "F16", "bfloat16": "BF16", "float32": "F32",
    "float64": "F64", "complex64": "C64", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
}
ST_DTYPES = {code: np.dtype(name) for name, code in ST_CODES.items()}
# Exact widenings of dtypes safetensors cannot hold (export).
ST_WIDEN = {"int4": "int8", "float8_e4m3b11fnuz": "float32"}


@dataclasses.dataclass(frozen=True)
class Entry:
  """One tensor of a file: its data is bytes [begin, end) after the header."""
  key: str
  dtype: np.dtype
  shape: tuple[int, ...]
  begin: int
  end: int


@dataclasses.dataclass(frozen=True)
class Header:
  """A parsed header: ``data_start`` is where the data begins in the file
  (8 + N), ``data_end`` the largest end offset (the data bytes the file
  must hold)."""
  where: str
  tensors: dict[str, Entry]
  metadata: dict[str, str]
  data_start: int
  data_end: int


def header_length(head: bytes, where: str) -> int:
  """N, from the file's first 8 bytes, refused when out of bounds."""
  if len(head) < 8:
    raise CorruptCheckpointError(
        f"{where} is not a safetensors file: {len(head)} bytes, fewer than "
        "the 8 of a header length")
  n = int.from_bytes(head[:8], "little")
  if n < 2 or n > MAX_HEADER_BYTES:
    raise CorruptCheckpointError(
        f"{where} is not a safetensors file: its header length claims {n} "
        f"bytes; expected 2.."
        f"{MAX_HEADER_BYTES} (ckpt.hf.header.MAX_HEADER_BYTES); refused "
        "unread")
  return n


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  out = dict(pairs)
  if len(out) != len(pairs):
    seen: set[str] = set()
    dup = next(k for k, _ in pairs if k in seen or seen.add(k))
    raise ValueError(f"the key {dup[:200]!r} appears twice")
  return out


def decode_json(doc: bytes, where: str, what: str = "safetensors header"
                ) -> dict:
  """A JSON object from untrusted bytes, counted before it is decoded
  (the docstring's bounds)."""
  n = len(doc)
  containers = doc.count(b"[") + doc.count(b"{")
  strings = doc.count(b'"') // 2
  if (containers > n // _BYTES_PER_CONTAINER + _SLACK or
      strings > n // _BYTES_PER_STRING + _SLACK):
    raise CorruptCheckpointError(
        f"{where}: the {what} ({n} bytes) holds {containers} "
        f"JSON containers and {strings} strings, more than a header holds "
        f"(at most one container per {_BYTES_PER_CONTAINER} bytes and one "
        f"string per {_BYTES_PER_STRING}); refused before decoding")
  try:
    out = json.loads(doc, object_pairs_hook=_no_duplicates)
  except (ValueError, RecursionError) as e:
    raise CorruptCheckpointError(
        f"{where}: the {what} is not valid JSON: {str(e)[:300]}") from None
  if not isinstance(out, dict):
    raise CorruptCheckpointError(
        f"{where}: the {what} is a JSON {type(out).__name__}, not an object")
  return out


def _int_list(v: Any, most: int) -> bool:
  return (isinstance(v, list) and len(v) <= most and
          all(type(x) is int and x >= 0 for x in v))


def _entry(where: str, key: str, spec: Any) -> Entry:
  if not isinstance(spec, dict):
    raise CorruptCheckpointError(
        f"{where}: tensor {key[:200]!r}: expected an object with dtype, "
        f"shape and data_offsets, found {str(spec)[:200]}")
  code = spec.get("dtype")
  if code not in ST_DTYPES:
    raise CorruptCheckpointError(
        f"{where}: tensor {key[:200]!r} has dtype {str(code)[:50]!r}, not "
        f"one ckpt reads ({', '.join(sorted(ST_DTYPES))})")
  shape, offsets = spec.get("shape"), spec.get("data_offsets")
  if not _int_list(shape, MAX_RANK):
    raise CorruptCheckpointError(
        f"{where}: tensor {key[:200]!r}: shape {str(shape)[:200]} is not a "
        f"list of at most {MAX_RANK} non-negative ints")
  if not _int_list(offsets, 2) or len(offsets) != 2:
    raise CorruptCheckpointError(
        f"{where}: tensor {key[:200]!r}: data_offsets {str(offsets)[:200]} "
        "is not [begin, end] (non-negative ints)")
  dtype = ST_DTYPES[code]
  begin, end = offsets
  want = math.prod(shape) * dtype.itemsize
  if end < begin or end - begin != want:
    raise CorruptCheckpointError(
        f"{where}: tensor {key[:200]!r}: data_offsets [{begin}, {end}] hold "
        f"{end - begin} bytes; shape {shape} of {code} is {want} bytes")
  return Entry(key, dtype, tuple(shape), begin, end)


def parse(doc: bytes, where: str) -> Header:
  """The header whose JSON is ``doc`` (the N bytes after the length)."""
  raw = decode_json(doc, where)
  meta = raw.pop("__metadata__", None) or {}
  if not isinstance(meta, dict) or not all(
      isinstance(v, str) for v in meta.values()):
    raise CorruptCheckpointError(
        f"{where}: __metadata__ is not an object of strings: "
        f"{str(meta)[:200]}")
  tensors = {k: _entry(where, k, v) for k, v in raw.items()}
  # No two tensors share a byte (empty tensors share none).
  spans = sorted((t.begin, t.end, t.key) for t in tensors.values()
                 if t.end > t.begin)
  for (b0, e0, k0), (b1, e1, k1) in zip(spans, spans[1:]):
    if b1 < e0:
      raise CorruptCheckpointError(
          f"{where}: tensors {k0[:200]!r} (bytes {b0}..{e0}) and "
          f"{k1[:200]!r} (bytes {b1}..{e1}) overlap")
  end = max((t.end for t in tensors.values()), default=0)
  return Header(where, tensors, meta, 8 + len(doc), end)


def header_bytes(header: dict[str, Any], meta: dict[str, str]) -> bytes:
  """The length and JSON of a header we write (data 8-byte aligned)."""
  doc = json.dumps({"__metadata__": meta, **header},
                   separators=(",", ":")).encode()
  doc += b" " * (-len(doc) % 8)
  return len(doc).to_bytes(8, "little") + doc
