"""Hostile safetensors files and index JSONs: each refused by
load_safetensors with a CorruptCheckpointError naming the file and the
tensor, in bounded time and memory (docs/huggingface.md "Untrusted files")."""

from __future__ import annotations

import json
import os
import time
import tracemalloc

import numpy as np
import pytest

import ckpt
from ckpt.errors import CorruptCheckpointError
from ckpt.hf import header as header_lib

# Generous for a shared 2-core machine; every case here takes milliseconds.
BOUND_S = 5.0
BOUND_BYTES = 8 << 20


def write(path, head, data: bytes = b"", length: int | None = None) -> str:
  doc = head if isinstance(head, bytes) else json.dumps(head).encode()
  n = len(doc) if length is None else length
  with open(path, "wb") as f:
    f.write(n.to_bytes(8, "little") + doc + data)
  return str(path)


def refused(src, match: str) -> tuple[float, int]:
  """Loads ``src``: it must raise naming ``match``; (seconds, peak bytes
  python allocated)."""
  tracemalloc.start()
  t = time.perf_counter()
  try:
    with pytest.raises(CorruptCheckpointError, match=match):
      ckpt.load_safetensors(src, target=None)
    return time.perf_counter() - t, tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()


def check_bounded(seconds: float, peak: int) -> None:
  assert seconds < BOUND_S, seconds
  assert peak < BOUND_BYTES, peak


def test_offsets_outside_the_file(tmp_path):
  f = write(tmp_path / "m.safetensors",
            {"w": {"dtype": "F32", "shape": [1024],
                   "data_offsets": [0, 4096]}}, bytes(16))
  check_bounded(*refused(f, r"'w' \(shape \[1024\]\) ends at byte .* past "
                         "its end"))


def test_overlapping_tensors(tmp_path):
  f = write(tmp_path / "m.safetensors", {
      "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
            bytes(24))
  check_bounded(*refused(f, r"'a' \(bytes 0..16\) and 'b' \(bytes 8..24\) "
                         "overlap"))


def test_a_header_claiming_2_to_the_40_elements(tmp_path):
  # Consistent offsets (4 TiB of float32) in a file of 16 bytes: the probe
  # of the last byte claimed refuses it; nothing of that size is allocated.
  n = 1 << 40
  f = write(tmp_path / "a.safetensors",
            {"w": {"dtype": "F32", "shape": [1 << 20, 1 << 20],
                   "data_offsets": [0, 4 * n]}}, bytes(16))
  check_bounded(*refused(f, r"'w' \(shape \[1048576, 1048576\]\) ends at "
                         "byte 4398046511"))
  # Offsets that do not hold the shape claimed.
  g = write(tmp_path / "b.safetensors",
            {"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 16]}},
            bytes(16))
  check_bounded(*refused(g, r"'w': data_offsets \[0, 16\] hold 16 bytes; "
                         r"shape \[1099511627776\] of F32 is 4398046511104"))


def test_a_100_mb_header_is_refused_unread(tmp_path):
  path = tmp_path / "m.safetensors"
  with open(path, "wb") as f:  # sparse: 100 MB on the file system, no disk
    f.write((100 << 20).to_bytes(8, "little") + b"{")
    f.truncate(8 + (100 << 20))
  seconds, peak = refused(str(path), "header length claims 104857600 bytes")
  check_bounded(seconds, peak)
  assert peak < 1 << 20  # nothing of the header was read


def test_an_unknown_dtype(tmp_path):
  f = write(tmp_path / "m.safetensors",
            {"w": {"dtype": "F99", "shape": [4], "data_offsets": [0, 16]}},
            bytes(16))
  check_bounded(*refused(f, r"'w' has dtype 'F99', not one ckpt reads"))


@pytest.mark.parametrize("doc,match", [
    (b"[" * 50_000 + b"]" * 50_000, "not valid JSON"),  # past the recursion limit
    (b"[" * 300_000 + b"]" * 300_000, "refused before decoding"),
    (b'{"x": ["' + b'a", "' * 200_000 + b'"]}', "refused before decoding"),
    (b'{"w": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, '
     b'"w": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}',
     "appears twice"),
    (b"not json", "not valid JSON"),
    (b"[1, 2]", "not an object"),
    (b'{"__metadata__": {"a": 1}}', "not an object of strings"),
])
def test_json_that_is_not_a_header(tmp_path, doc, match):
  f = write(tmp_path / "m.safetensors", doc, bytes(8))
  check_bounded(*refused(f, match))


def test_a_truncated_file(tmp_path):
  f = write(tmp_path / "m.safetensors", b"{}", length=400)
  check_bounded(*refused(f, "past the end of the file"))
  (tmp_path / "m.safetensors").write_bytes(b"abc")
  check_bounded(*refused(f, "past the end of the file"))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/x.safetensors",
                                  "sub/x.safetensors", ".hidden.safetensors",
                                  "x.bin"])
def test_an_index_naming_a_file_outside_its_directory(tmp_path, name):
  (tmp_path / "d").mkdir()
  write(tmp_path / "outside.safetensors",
        {"w": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}, bytes(4))
  (tmp_path / "d" / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"w": name}}))
  check_bounded(*refused(str(tmp_path / "d"), "not a plain file name"))


def test_the_densest_header_allowed_decodes_within_its_bound():
  # The docstring's bound: the densest lists a header may hold at the
  # length limit cost at most ~150 MB to decode. Here 1 MiB of them, under
  # tracemalloc, scaled.
  n = 1 << 20
  unit = b"[1234567890123],"
  doc = b'{"x":[' + unit * ((n - 16) // len(unit))
  doc = doc[:-1] + b"]}"
  tracemalloc.start()
  try:
    with pytest.raises(CorruptCheckpointError, match="expected an object"):
      header_lib.parse(doc, "w")
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  per_byte = peak / len(doc)
  assert per_byte * header_lib.MAX_HEADER_BYTES < 200 << 20, per_byte


def test_a_good_file_next_to_these_still_loads(tmp_path):
  f = write(tmp_path / "m.safetensors",
            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            np.array([1, 2], np.float32).tobytes())
  got = ckpt.load_safetensors(f, target=None)
  assert got["w"].tolist() == [1.0, 2.0]
  assert os.path.getsize(f) == 8 + len(json.dumps(
      {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})) + 8


@pytest.mark.parametrize("doc,match", [
    (b"[" * 300_000 + b"]" * 300_000, "index JSON .* refused before decoding"),
    (b"{", "index JSON is not valid JSON"),
    (b'{"weight_map": 3}', "no weight_map object"),
])
def test_an_index_json_that_is_not_one(tmp_path, doc, match):
  (tmp_path / "model.safetensors.index.json").write_bytes(doc)
  check_bounded(*refused(str(tmp_path), match))
