"""The root metadata of a Checkpointer's directory (ckpt/format/root_metadata.py).

``RootMetadataFile`` owns ``Checkpointer(custom_metadata=...)``: process 0
writes it once, in the agreement round of the Checkpointer's first save
(``Saver._prepare_attempt``; a failure to write it refuses that save on
every process, before anything of the step is written), and any process
reads it back (``Checkpointer.root_metadata()``).

Written once: a root that holds one already keeps it. A Checkpointer
reopened with a different dict logs one WARNING naming both and writes
nothing; ``root_metadata()`` returns what the root holds (the first run's
record), as Orbax's CheckpointManager leaves an existing file as it is.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from absl import logging

from ckpt.format import root_metadata as format_lib
from ckpt.multihost import process as multihost
from ckpt.store import storage as storage_lib


@dataclasses.dataclass(frozen=True)
class RootMetadata:
  """What ``Checkpointer.root_metadata()`` returns (Orbax's RootMetadata):
  ``custom_metadata``, the dict given as ``Checkpointer(custom_metadata=)``
  when the directory was first written ({} if none)."""
  custom_metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


class RootMetadataFile:
  """The ``root_metadata`` file of one directory (module docstring)."""

  def __init__(self, storage: storage_lib.Storage, text: str | None):
    self.storage = storage
    self._text = text  # checked JSON text, or None: none given
    self._done = text is None

  def _where(self) -> str:
    return f"{self.storage.url.rstrip('/')}/{format_lib.NAME}"

  def read(self) -> dict | None:
    """The dict the root holds (None: no file)."""
    return format_lib.read(self.storage)

  def write_once(self) -> None:
    """Process 0, in the round of a save: writes the file unless the root
    holds one (then compares, and warns if they differ). Once per
    Checkpointer."""
    if self._done or multihost.process_index() != 0:
      return
    given = json.loads(self._text)
    found = self.read()
    if found is None:
      self.storage.write_bytes(format_lib.NAME, format_lib.encode(self._text))
    elif found != given:
      logging.warning(
          "ckpt: %s holds root metadata %.300s; this Checkpointer was given "
          "%.300s. Root metadata is written once: the directory keeps what "
          "it holds (root_metadata() returns it). To change it, use a new "
          "directory", self._where(), json.dumps(found), json.dumps(given))
    self._done = True

  def current(self) -> RootMetadata:
    """What the root holds; before the first save has written it, the dict
    this Checkpointer will write ({} if none)."""
    found = self.read()
    if found is None:
      found = {} if self._text is None else json.loads(self._text)
    return RootMetadata(found)
