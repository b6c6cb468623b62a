"""Exceptions raised by ckpt.

Every error a user can cause is one of these (never an ``assert``), and its
message names the leaf path, what was expected and what was found.
"""

from __future__ import annotations


class CheckpointError(Exception):
  """Base class of every error ckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
  """A directory holds no committed checkpoint, or a step does not exist."""


class CorruptCheckpointError(CheckpointError):
  """An index or array is unreadable, truncated, or fails validation."""


class OrbaxImportError(CheckpointError):
  """An Orbax checkpoint (``ckpt import``), or a part of one, that ckpt
  cannot import: unsupported, or refused as hostile or corrupt (a key that
  leaves its directory, a shape, mesh or JSON nesting out of bounds, arrays
  claiming far more bytes than the source stores). The message names the
  file and the problem."""


class TreeMismatchError(CheckpointError, ValueError):
  """The checkpoint and the target (or the state) disagree on a leaf."""


class MissingLeavesError(TreeMismatchError):
  """Target leaves that neither the checkpoint nor a fallback provide."""

  def __init__(self, missing: list[str], available: list[str]):
    self.missing = list(missing)
    shown = ", ".join(sorted(available)[:20])
    more = "" if len(available) <= 20 else f", ... ({len(available)} in all)"
    super().__init__(
        f"{len(missing)} target leaves are missing from the checkpoint: "
        f"{', '.join(missing)}. The checkpoint has: [{shown}{more}]. Pass "
        "fallback_state= or a restore transform that provides them."
    )


class InvalidStateError(CheckpointError, TypeError):
  """A state handed to save() holds something ckpt cannot store."""


class BarrierTimeoutError(CheckpointError, TimeoutError):
  """Not every process reached a barrier within the timeout."""


class StoreTimeoutError(CheckpointError, TimeoutError):
  """An operation on a store did not finish within its bound
  (``save_timeout_s``, ``query_timeout_s``; see ckpt/store/deadline.py). The
  message names the operation, the URL, the bound and the option."""
  deadline = None  # the ckpt.store.deadline.Deadline it ran past
  doing = None     # the store call it was waiting for, when known


class WaitTimeoutError(CheckpointError, TimeoutError):
  """``wait_until_finished(timeout=...)`` ran out of time; the save it waited
  for is still tracked (the next wait, save or close waits for it again)."""
