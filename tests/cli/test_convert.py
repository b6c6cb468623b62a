"""ckpt.cli.convert without the command: key nesting and hostile safetensors."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from ckpt.cli import convert


def write_safetensors(path, header: dict, body: bytes) -> None:
  doc = json.dumps(header).encode()
  path.write_bytes(len(doc).to_bytes(8, "little") + doc + body)


def test_nest_keys():
  assert convert.nest_keys({"a/b/c": 1, "a/d": 2, "e": 3}) == {
      "a": {"b": {"c": 1}, "d": 2}, "e": 3}
  assert convert.nest_keys({"a.b": 1}, sep=".") == {"a": {"b": 1}}
  assert convert.nest_keys({"a/b": 1}, sep="") == {"a/b": 1}


@pytest.mark.parametrize("keys", [["a/b", "a/b/c"], ["a/b/c", "a/b"],
                                  ["a//b"], ["/a"]])
def test_nest_keys_refuses_ambiguous_keys(keys):
  with pytest.raises(convert.ConvertError, match="key"):
    convert.nest_keys({k: 0 for k in keys})


def test_read_safetensors_float8_and_bfloat16(tmp_path):
  f8 = np.arange(6, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
  bf = np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16)
  write_safetensors(tmp_path / "x.safetensors", {
      "f8": {"dtype": "F8_E4M3", "shape": [2, 3], "data_offsets": [0, 6]},
      "bf": {"dtype": "BF16", "shape": [4], "data_offsets": [6, 14]},
  }, f8.tobytes() + bf.tobytes())
  got, meta = convert.read_safetensors(tmp_path / "x.safetensors")
  assert meta == {}
  assert got["f8"].dtype == f8.dtype and got["f8"].shape == (2, 3)
  assert got["f8"].tobytes() == f8.tobytes()
  assert got["bf"].dtype == bf.dtype and got["bf"].tobytes() == bf.tobytes()


@pytest.mark.parametrize("entry,match", [
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}, "offsets"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}, "offsets"),
    ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, "shape"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}, "offsets"),
    ({"dtype": "X99", "shape": [4], "data_offsets": [0, 16]}, "dtype 'X99'"),
    ({"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}, "shape"),
    ("nope", "expected an object"),
])
def test_read_safetensors_refuses_bad_entries(tmp_path, entry, match):
  write_safetensors(tmp_path / "x.safetensors", {"t": entry}, bytes(16))
  with pytest.raises(convert.ConvertError, match=match):
    convert.read_safetensors(tmp_path / "x.safetensors")


@pytest.mark.parametrize("data", [b"", b"\x00" * 7, (10**12).to_bytes(8, "little"),
                                  (4).to_bytes(8, "little") + b"[1] "])
def test_read_safetensors_refuses_bad_headers(tmp_path, data):
  (tmp_path / "x.safetensors").write_bytes(data)
  with pytest.raises(convert.ConvertError):
    convert.read_safetensors(tmp_path / "x.safetensors")
