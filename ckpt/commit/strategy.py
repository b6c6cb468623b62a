"""The commit protocol's two kinds, chosen once per storage (``for_storage``).

ckpt/commit/protocol.py describes the protocol; what differs between media is
behind one interface, so that the modules above ask the storage's kind
instead of testing ``storage.is_posix`` at every step:

- ``RenameCommit`` (ckpt/commit/rename.py, POSIX file systems): an attempt
  writes into ``checkpoint_<step>.tmp-<token>/`` and its commit is one
  atomic ``rename`` to ``checkpoint_<step>/``.
- ``MarkerCommit`` (ckpt/commit/marker.py, object stores and ``memory://``):
  an attempt writes into ``checkpoint_<step>/attempt-<token>/`` and its
  commit is a create-only marker, then the flat record ``commits/<step>``.

Both answer, for a storage: ``work_dir``, ``is_committed``,
``committed_steps``, ``not_committed_reason``, ``attempts_with_index``,
``read_lease``, ``pending_gone``, ``start_attempt`` and ``publish``. They
hold no state; ``for_storage`` is the one place that picks one.
"""

from __future__ import annotations

from ckpt.commit.marker import MarkerCommit
from ckpt.commit.rename import RenameCommit
from ckpt.store import storage as storage_lib

RENAME = RenameCommit()
MARKER = MarkerCommit()
Kind = RenameCommit | MarkerCommit


def for_storage(storage: storage_lib.Storage) -> Kind:
  """The commit protocol of ``storage``'s medium: the one place that picks."""
  return RENAME if storage.is_posix else MARKER
