"""The safetensors files of a source, read by byte range through TensorStore.

A source is one ``.safetensors`` file, a ``model.safetensors.index.json``,
or a directory (its index JSON if it has one, else every ``*.safetensors``
in it), given as a path or a ``file://``, ``gs://`` or ``s3://`` URL. Its
directory is opened as ckpt opens a checkpoint root (ckpt/store/storage.py:
the kvstore spec of the URL, ``storage_options`` merged, the same context
with its retries), so every read is a TensorStore kvstore read of one byte
range: the 8 bytes of a header's length, the header, one probe of the last
byte the header claims (the file must hold it), and then only the ranges of
the tensors' rows a process needs (ckpt/hf/leaves.py).

File names come from an untrusted index JSON (at most 32 MiB, decoded
within the bounds of ckpt/hf/header.py's headers): each must be a plain
name (``[A-Za-z0-9_.-]``, ending in ``.safetensors``, no directory), so no
read leaves the directory.
"""

from __future__ import annotations

import os
import re

import tensorstore as ts

from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.hf import header as header_lib
from ckpt.restore.tasks import gather_or_cancel
from ckpt.store import storage as storage_lib
from ckpt.store import tsfuture

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = 32 << 20
_FILE_NAME = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*\.safetensors$")
# How a ranged read past the end of a file fails (storage.py's list).
_PAST_END = ("OUT_OF_RANGE", "not satisfied", "not valid for value of size",
             "Content-Range")


def split_source(src) -> tuple[str, str | None]:
  """(the directory URL, the file or index name in it, or None for the
  directory itself)."""
  src = os.fspath(src)
  if src.endswith(".safetensors") or src.endswith(".json"):
    if "://" in src:
      scheme, rest = src.split("://", 1)
      head, _, name = rest.rstrip("/").rpartition("/")
      return f"{scheme}://{head}", name
    return os.path.dirname(os.path.abspath(src)), os.path.basename(src)
  return src, None


def parse_index(data: bytes, where: str) -> dict[str, str]:
  """{tensor key: file name} of an index JSON, its names checked."""
  doc = header_lib.decode_json(data, where, "index JSON")
  weight_map = doc.get("weight_map")
  if not isinstance(weight_map, dict):
    raise CorruptCheckpointError(f"{where} has no weight_map object")
  for key, name in weight_map.items():
    if not isinstance(name, str) or not _FILE_NAME.match(name):
      raise CorruptCheckpointError(
          f"{where}: tensor {key[:200]!r} is mapped to {str(name)[:200]!r}, "
          "not a plain file name ending in .safetensors; refused (a name "
          "from the index never leaves its directory)")
  return weight_map


class Source:
  """The open directory of a source and the files to read in it."""

  def __init__(self, src, storage_options: dict | None = None):
    self.src = os.fspath(src)
    directory, name = split_source(self.src)
    self.storage = storage_lib.Storage(directory, storage_options)
    self.context = self.storage.context()
    self._kv: ts.KvStore | None = None
    self.weight_map: dict[str, str] | None = None
    if name is not None and name.endswith(".json"):
      self.files = self._from_index(name)
    elif name is not None:
      self.files = [name]
    elif self._exists(INDEX_NAME):
      self.files = self._from_index(INDEX_NAME)
    else:
      self.files = self._listed()

  def where(self, name: str) -> str:
    return f"{self.storage.url.rstrip('/')}/{name}"

  def _exists(self, name: str) -> bool:
    return self.storage.exists(name)

  def _from_index(self, name: str) -> list[str]:
    data = self.storage.read_bytes(name, limit=MAX_INDEX_BYTES)
    if data is None:
      raise CheckpointError(f"{self.where(name)} does not exist")
    self.weight_map = parse_index(data, self.where(name))
    return sorted(set(self.weight_map.values()))

  def _listed(self) -> list[str]:
    if self.storage.is_posix:
      root = os.fspath(self.storage.root)
      if not os.path.exists(root):
        raise CheckpointError(f"{self.src} does not exist")
      if not os.path.isdir(root):
        raise CheckpointError(f"{self.src} is neither a .safetensors file, "
                              "an index JSON nor a directory")
      names = os.listdir(root)
    else:
      names = self.storage.list_all()
    files = sorted(n for n in names if "/" not in n and _FILE_NAME.match(n))
    if not files:
      raise CheckpointError(
          f"{self.src} holds no .safetensors files (and no {INDEX_NAME})")
    return files

  async def kv(self) -> ts.KvStore:
    if self._kv is None:
      with self.storage.store_errors("opening"):
        self._kv = await tsfuture.wait(
            ts.KvStore.open(self.storage.spec, context=self.context))
    return self._kv

  async def read_range(self, name: str, begin: int, end: int) -> bytes:
    """Bytes [begin, end) of file ``name`` (exactly that many, or an
    error naming the file)."""
    kv = await self.kv()
    try:
      r = await tsfuture.wait(kv.read(name, byte_range=slice(begin, end)))
    except Exception as e:  # pylint: disable=broad-except
      if any(s in str(e) for s in _PAST_END):
        raise CorruptCheckpointError(
            f"{self.where(name)}: bytes {begin}..{end} are past the end of "
            "the file (truncated, or a header claiming more than it holds)"
        ) from None
      if isinstance(e, CheckpointError):
        raise
      raise CheckpointError(f"reading bytes {begin}..{end} of "
                            f"{self.where(name)} failed: {e}") from e
    if r.state == "missing":
      raise CheckpointError(f"{self.where(name)} does not exist")
    data = r.value
    if len(data) != end - begin:
      raise CorruptCheckpointError(
          f"{self.where(name)}: asked bytes {begin}..{end}, got {len(data)} "
          "bytes (the file is shorter than its header says)")
    return data

  async def header(self, name: str) -> header_lib.Header:
    where = self.where(name)
    n = header_lib.header_length(await self.read_range(name, 0, 8), where)
    head = header_lib.parse(await self.read_range(name, 8, 8 + n), where)
    if head.data_end:  # the file holds the last byte its header claims
      last = head.data_start + head.data_end
      try:
        await self.read_range(name, last - 1, last)
      except CorruptCheckpointError:
        worst = max(head.tensors.values(), key=lambda t: t.end)
        raise CorruptCheckpointError(
            f"{where}: tensor {worst.key[:200]!r} (shape "
            f"{list(worst.shape)}) ends at byte {last} of the file, past its "
            "end: a header claiming more data than the file holds") from None
    return head

  async def headers(self) -> dict[str, header_lib.Header]:
    """Every file's header, read at once; with an index, each key it maps
    checked to be in its file."""
    got = await gather_or_cancel(*(self.header(f) for f in self.files))
    out = dict(zip(self.files, got))
    if self.weight_map is not None:
      for key, name in self.weight_map.items():
        if key not in out[name].tensors:
          raise CorruptCheckpointError(
              f"the index maps {key[:200]!r} to {name}, whose header has no "
              "such tensor")
    return out
