"""The commit protocol's two kinds, chosen once per storage (``for_storage``).

ckpt/commit/protocol.py describes the protocol; what differs between media is
behind one interface, ``CommitKind``, so that the modules above ask the
storage's kind instead of testing ``storage.is_posix`` at every step:

- ``RenameCommit`` (ckpt/commit/rename.py, POSIX file systems): an attempt
  writes into ``checkpoint_<step>.tmp-<token>/`` and its commit is one
  atomic ``rename`` to ``checkpoint_<step>/``.
- ``MarkerCommit`` (ckpt/commit/marker.py, object stores and ``memory://``):
  an attempt writes into ``checkpoint_<step>/attempt-<token>/`` and its
  commit is a create-only marker, then the flat record ``commits/<step>``.

A kind is bound to one storage when it is made; it holds nothing else.
``for_storage`` is the one place that picks one.
"""

from __future__ import annotations

from typing import Callable, Protocol

from ckpt.commit import lease as lease_lib
from ckpt.commit.attempt import Cleaner
from ckpt.commit.marker import MarkerCommit
from ckpt.commit.rename import RenameCommit
from ckpt.store import storage as storage_lib


class Lease(Protocol):
  """An attempt's lease file, as ckpt/commit/renewal.py renews it."""

  def prime(self) -> str | None: ...

  def renew(self, data: bytes, count: int) -> str | None: ...


class Clock(Protocol):
  """How one cleanup pass dates the leases it finds."""

  def age_s(self, rel: str, generation: bytes | None) -> float | None: ...

  def forget_unseen(self) -> None: ...


class CommitKind(Protocol):
  """What both kinds answer, for the storage they are bound to (the
  methods' docstrings are in ckpt/commit/rename.py and marker.py)."""

  storage: storage_lib.Storage
  least_renewal_s: float  # the shortest time between two lease renewals
  stale_lease: str        # how an expired lease's age reads ({age})

  # An attempt: its directory, its files, its lease, its commit.
  def work_dir(self, step: int, token: str) -> str: ...

  def start_attempt(self, step: int, token: str, lease_s: float,
                    seen: lease_lib.Sightings | None,
                    cleaner: Cleaner) -> str: ...

  def write_into_attempt(self, work_dir: str, rel: str, data: bytes,
                         what: str) -> None: ...

  def lease(self, key: str, token: str, request_s: float) -> Lease: ...

  def read_lease(self, key: str) -> tuple[bytes | None, bytes | None]: ...

  def pending_gone(self, step: int, token: str) -> str | None: ...

  def publish(self, step: int, token: str, index_data: bytes,
              lease_gen: bytes | None) -> None: ...

  # The committed steps.
  def ensure_records(self) -> None: ...

  def is_committed(self, step: int) -> bool: ...

  def committed_steps(self) -> list[int]: ...

  def not_committed_reason(self, step: int) -> str | None: ...

  def attempts_with_index(self) -> list[str]: ...

  # Cleanup.
  def clock(self, seen: lease_lib.Sightings | None) -> Clock: ...

  def abandoned(self, live: Callable[[str], bool | None]) -> list[str]: ...

  def holds_nothing(self, rel: str) -> bool: ...

  def finish_deletion(self, rel: str) -> bool: ...

  def remove_leftovers(self, step: int) -> bool: ...

  def remove(self, rel: str, step: int | None, what: str) -> None: ...


def for_storage(storage: storage_lib.Storage) -> CommitKind:
  """The commit protocol of ``storage``'s medium, bound to it: the one
  place that picks."""
  return RenameCommit(storage) if storage.is_posix else MarkerCommit(storage)
