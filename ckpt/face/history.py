"""What ``should_save`` knows of this Checkpointer's saves.

``SaveHistory`` owns the step of the last save (``should_save_fn``'s second
argument: agreed, as saves are collective, or the newest committed step
before it) and whether the directory holds a checkpoint (the first-step
rule). Both are learnt from the saves and from agreed listings, and
forgotten when a deletion, a cancel or a reload may have changed them.
"""

from __future__ import annotations

from typing import Any

# A fact not known yet (before a listing).
UNKNOWN = object()


class SaveHistory:
  """The facts of ``should_save`` (see the module docstring)."""

  def __init__(self):
    # UNKNOWN until asked; None: no step. None: not asked.
    self._last_saved: Any = UNKNOWN
    self._has_checkpoint: bool | None = None

  @property
  def last_saved(self) -> Any:
    """The step of the last save (None: none), UNKNOWN until known."""
    return self._last_saved

  @property
  def has_checkpoint(self) -> bool | None:
    """Whether the directory holds a checkpoint (None: not known)."""
    return self._has_checkpoint

  def saved(self, step: int) -> None:
    """Agreed in a save round: ``step`` is committed, or about to be."""
    self._has_checkpoint = True
    self._last_saved = step

  def agreed_last_saved(self, step: int | None) -> None:
    """Every process agreed that ``step`` is the newest step (a listing)."""
    self._last_saved = step
    if step is not None:
      self._has_checkpoint = True

  def agreed_not_empty(self) -> None:
    """Every process agreed that the directory holds a checkpoint."""
    self._has_checkpoint = True

  def forget(self) -> None:
    """The last saved step may have changed: the save in flight was
    cancelled, a step deleted, the Checkpointer reloaded."""
    self._last_saved = UNKNOWN
