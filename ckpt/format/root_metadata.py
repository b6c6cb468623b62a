"""``root_metadata``: one small JSON dict for a whole checkpoint root.

``Checkpointer(..., custom_metadata={...})`` (Orbax's root metadata: model
config, code version, run id) is written once, by process 0, at the
directory's root as ``root_metadata``: a JSON document sealed with a crc32c
trailer (ckpt/format/seal.py)::

    {"format": "ckpt-root-metadata", "version": 1,
     "custom_metadata": {...}} c4 04 <crc32c>

It belongs to no step, so retention never deletes it; a root without it
reads as ``{}``. At most ``MAX_ROOT_METADATA_BYTES`` (checked when written
and before it is read: an untrusted file is never parsed past the bound).
"""

from __future__ import annotations

import json
from typing import Any

from ckpt.errors import CorruptCheckpointError
from ckpt.format import extras
from ckpt.format import seal

NAME = "root_metadata"
FORMAT = "ckpt-root-metadata"
VERSION = 1
# A small dict: what a run is, not what it learnt (that is state or
# step metadata).
MAX_ROOT_METADATA_BYTES = 64 << 10


def check(value: Any) -> str | None:
  """``custom_metadata=`` of a Checkpointer as JSON text (None: none);
  ValueError saying where it is not a JSON-able dict or too large."""
  try:
    text = extras.check_custom_metadata(value)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"Checkpointer(custom_metadata=...): {e}") from None
  if text is not None and len(text.encode()) > MAX_ROOT_METADATA_BYTES:
    raise ValueError(
        f"Checkpointer(custom_metadata=...) is {len(text.encode())} bytes as "
        f"JSON; at most {MAX_ROOT_METADATA_BYTES} (ckpt.format.root_metadata."
        "MAX_ROOT_METADATA_BYTES): it describes the run; keep large values "
        "in the state or in save(custom_metadata=...)")
  return text


def encode(text: str) -> bytes:
  """The sealed bytes of the file for ``check``'s JSON text."""
  body = json.dumps({"format": FORMAT, "version": VERSION,
                     "custom_metadata": json.loads(text)},
                    sort_keys=True, separators=(",", ":")).encode()
  return seal.seal(body)


def decode(data: bytes, where: str) -> dict:
  """The custom_metadata dict of a ``root_metadata`` file, checked (its
  trailer, its size, its shape); CorruptCheckpointError naming ``where``."""
  if len(data) > MAX_ROOT_METADATA_BYTES + 256:
    raise CorruptCheckpointError(
        f"{where}: {len(data)} bytes; a root_metadata file holds at most "
        f"{MAX_ROOT_METADATA_BYTES} bytes of JSON")
  body = seal.unseal(data, where)
  try:
    doc = json.loads(body)
  except (ValueError, RecursionError) as e:
    raise CorruptCheckpointError(f"{where}: not valid JSON: {e}") from None
  if not (isinstance(doc, dict) and doc.get("format") == FORMAT and
          isinstance(doc.get("custom_metadata"), dict)):
    raise CorruptCheckpointError(
        f"{where}: expected a JSON object with \"format\": {FORMAT!r} and a "
        f"\"custom_metadata\" object, got {bytes(body[:120])!r}")
  if doc.get("version") != VERSION:
    raise CorruptCheckpointError(
        f"{where}: version {doc.get('version')!r}; this ckpt reads version "
        f"{VERSION}: upgrade ckpt")
  return doc["custom_metadata"]


def read(storage: Any) -> dict | None:
  """The custom_metadata of the ``root_metadata`` file of ``storage``'s
  root (a ckpt Storage); None when there is none."""
  data = storage.read_bytes(NAME, limit=MAX_ROOT_METADATA_BYTES + 256)
  if data is None:
    return None
  return decode(data, f"{storage.url.rstrip('/')}/{NAME}")
