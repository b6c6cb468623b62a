"""The call of a save once its decision is known (``Checkpointer.save``, and
``MultiTierCheckpointer.save`` through the persistent tier's
``TierSide.save_as``): the step checked, the background loop entered (a
``close()`` begun meanwhile waits for it), the decision taken, then the
``Saver``'s save with this process's own checks (the loop open, no restore
in flight) joining its agreement round."""

from __future__ import annotations

from typing import Any, Callable

from ckpt.face import decision as decision_lib
from ckpt.face import loop as loop_lib
from ckpt.face import restorer as restorer_lib
from ckpt.face import saver as saver_lib
from ckpt.multihost import posts as posts_lib


class SaveCall:
  """A save after its decision (see the module docstring)."""

  def __init__(self, loop: loop_lib.BackgroundLoop, saver: saver_lib.Saver,
               restorer: restorer_lib.Restorer):
    self._loop = loop
    self._saver = saver
    self._restorer = restorer

  def save(self, step: int, state: Any,
           decide: Callable[[], decision_lib.Verdict], kwargs: dict) -> bool:
    """``Checkpointer.save`` once ``decide()`` (a ckpt/face/decision.py
    Verdict) said whether to save and whether the step is temporary;
    ``kwargs``: the Saver's (metrics, transforms, host_state,
    custom_metadata, progress)."""
    step = posts_lib.check_step(step)
    refused = posts_lib.failure_of(lambda: self._loop.enter(step))
    try:
      verdict = decide()
      if not verdict.save:
        # Agreed (ckpt/face/decision.py). A skip does not wait for the save
        # in flight: its failure comes from the next save that writes.
        return False
      return self._saver.save(
          step, state, refused, lambda: self._check(step),
          temporary=verdict.temporary, **kwargs)
    finally:
      if refused is None:  # a close() begun meanwhile waits for it
        self._loop.leave()

  def _check(self, step: int) -> None:
    """This process's own checks of a save (its failure joins the round)."""
    self._loop.check_open()
    self._restorer.check_no_pending(f"save({step})")
