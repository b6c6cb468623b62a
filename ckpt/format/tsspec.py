"""TensorStore array specs for one stored leaf, in each on-disk format.

The spec is fully determined by (format, shape, dtype, chunks, compression,
checksum), so every process builds the same one: process 0 creates the array and the
others open it with ``assume_metadata`` and write their chunks without
reading or racing on the metadata. For "ocdbt" the kvstore is the OCDBT
database a process writes into (``ckpt.store.ocdbt.process_database``) or, to
read, the step's merged database (see ckpt/store/ocdbt.py).

With ``Codec(checksum="crc32c")`` (``Checkpointer(chunk_checksums=True)``),
formats "zarr3" and "ocdbt" end every codec chain with zarr3's ``crc32c``
codec: TensorStore then checks each chunk's checksum whenever it decodes
it, so every read is verified (a mismatch is a DATA_LOSS error, which
ckpt/restore/lazy.py turns into CorruptCheckpointError naming the leaf). It is not
the default: with 64 MiB raw chunks it doubles restore time (measured
197 vs 104 ms for 256 MiB on a 16-core host: TensorStore checksums each
chunk on one thread as it decodes it), and a checksum of a chunk's bytes
does not see two chunks swapped. By default every format has its boxes
checksummed at save into per-process files (ckpt/restore/checksums.py), checked by
``verify`` and ``restore(verify=True)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ckpt.store import ocdbt

FORMATS = ("zarr", "zarr3", "ocdbt")
COMPRESSIONS = (None, "zstd")
# A chunk checksum codec: "crc32c" (zarr3's codec, last in the chain:
# TensorStore checks every chunk it decodes, on every read) or "none".
CHECKSUMS = ("none", "crc32c")


def default_checksum(fmt: str) -> str:  # pylint: disable=unused-argument
  """What a new array of ``fmt`` is written with when the Codec does not
  say: no checksum codec (its boxes are checksummed into per-process files,
  ckpt/restore/checksums.py); zarr v2 has none to offer anyway."""
  return "none"


@dataclasses.dataclass(frozen=True)
class Codec:
  """How chunks are encoded: ``compression`` is None (raw) or "zstd";
  ``checksum`` is "crc32c", "none", or None for the format's default
  (``default_checksum``)."""
  compression: str | None = None
  level: int = 1
  checksum: str | None = None

  def __post_init__(self):
    if self.compression not in COMPRESSIONS:
      raise ValueError(f"compression must be one of {COMPRESSIONS}, "
                       f"got {self.compression!r}")
    if self.checksum is not None and self.checksum not in CHECKSUMS:
      raise ValueError(f"checksum must be one of {CHECKSUMS} or None, "
                       f"got {self.checksum!r}")

  def to_json(self) -> dict[str, Any]:
    out: dict[str, Any] = {"compression": self.compression, "level": self.level}
    if self.checksum is not None:  # else the index entry gets the default
      out["checksum"] = self.checksum
    return out

  def resolved_checksum(self, fmt: str) -> str:
    if fmt == "zarr":
      return "none"  # zarr v2 has no checksum codec
    return default_checksum(fmt) if self.checksum is None else self.checksum


def chunk_checksum(fmt: str, on: bool) -> str | None:
  """The Codec checksum of ``Checkpointer(chunk_checksums=on)``."""
  if not on:
    return None
  if fmt == "zarr":
    raise ValueError("chunk_checksums=True needs format 'zarr3' or 'ocdbt' "
                     "(zarr v2 has no checksum codec); got format 'zarr'")
  return "crc32c"


def check_format(fmt: str) -> str:
  if fmt not in FORMATS:
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
  return fmt


def array_spec(fmt: str, kvstore: dict[str, Any], relpath: str,
               shape: tuple[int, ...], dtype: np.dtype,
               chunks: tuple[int, ...], codec: Codec) -> dict[str, Any]:
  """The spec of the array at ``relpath`` inside the step's ``kvstore``.

  For "ocdbt", ``kvstore`` is an OCDBT database spec or the directory that
  holds one.
  """
  dtype_name = np.dtype(dtype).name
  if fmt == "zarr":
    compressor = None
    if codec.compression == "zstd":
      compressor = {"id": "zstd", "level": codec.level}
    return {
        "driver": "zarr",
        "kvstore": _under(kvstore, relpath),
        "store_data_equal_to_fill_value": True,
        "dtype": dtype_name,
        "metadata": {"shape": list(shape), "chunks": list(chunks),
                     "compressor": compressor, "order": "C",
                     "dimension_separator": "."},
    }
  codecs: list[dict[str, Any]] = [
      {"name": "bytes", "configuration": {"endian": "little"}}]
  if codec.compression == "zstd":
    codecs.append({"name": "zstd", "configuration": {"level": codec.level}})
  if codec.resolved_checksum(fmt) == "crc32c":  # last: over the stored bytes
    codecs.append({"name": "crc32c"})
  if fmt == "ocdbt" and kvstore.get("driver") != "ocdbt":
    kvstore = ocdbt.database(kvstore)
  return {
      "driver": "zarr3",
      "kvstore": _under(kvstore, relpath),
      "store_data_equal_to_fill_value": True,
      "metadata": {
          "shape": list(shape), "data_type": dtype_name,
          "chunk_grid": {"name": "regular",
                         "configuration": {"chunk_shape": list(chunks)}},
          "chunk_key_encoding": {"name": "default"},
          "codecs": codecs,
      },
  }


def chunk_key(fmt: str, idx) -> str:
  """The key of the chunk at grid index ``idx`` inside its array, as
  ``array_spec`` makes TensorStore write it: zarr v2 with "." separators
  ("0" for a scalar), zarr3's default encoding ("c/0/1", "c")."""
  if fmt == "zarr":
    return ".".join(map(str, idx)) or "0"
  return "/".join(("c",) + tuple(map(str, idx)))


def _under(kvstore: dict[str, Any], relpath: str) -> dict[str, Any]:
  if kvstore.get("driver") == "ocdbt":
    return {**kvstore, "path": relpath.strip("/") + "/"}
  return {**kvstore, "path": kvstore["path"] + relpath.strip("/") + "/"}


def open_spec(fmt: str, kvstore: dict[str, Any], relpath: str,
              shape: tuple[int, ...], dtype: np.dtype, chunks: tuple[int, ...],
              codec: Codec) -> dict[str, Any]:
  """The spec to open an existing array, with the shape, dtype, chunks and
  codec its index entry records as constraints.

  The index is the one authority on how an array is stored: TensorStore
  compares the array's own metadata file (``.zarray`` / ``zarr.json``) with
  these and refuses to open on any difference (a chunk covering the whole
  array, another compressor or filter, extra zarr3 codecs such as
  ``sharding_indexed``), so a crafted metadata file cannot make a read decode
  more than the index's chunks.
  """
  spec = array_spec(fmt, kvstore, relpath, shape, dtype, chunks, codec)
  if fmt == "zarr":
    spec["metadata"]["filters"] = None
  spec.pop("store_data_equal_to_fill_value", None)
  return {**spec, "fill_missing_data_reads": False}


def codec_of(entry_codec: dict[str, Any]) -> Codec:
  """The Codec an index entry's (validated) codec map describes. An entry
  with no "checksum" (written before ckpt checksummed chunks) opens with no
  checksum codec, as it was written."""
  level = entry_codec.get("level", 1)
  checksum = "crc32c" if entry_codec.get("checksum") == "crc32c" else "none"
  return Codec(entry_codec.get("compression"),
               level if type(level) is int else 1, checksum)
