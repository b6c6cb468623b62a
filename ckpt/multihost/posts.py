"""Typed posts of an agreement round, and what every round's caller shares.

``agree`` encodes what a process posts and what process 0 decides once, each
side a plain dict (JSON); ``Verdict`` names what a process found (ok, failed,
found corrupt data). ``failure_of`` is the one way a process's own failure
joins a round: it is returned, not raised, so the process still posts it and
every process raises together (``describe``: what it posts of it).
``check_step`` checks a step argument before a round, ``refusal`` is the
message of a save refused in one (a Checkpointer and both tiers of a
MultiTierCheckpointer say the same).
"""

from __future__ import annotations

import enum
import json
import operator
from typing import Any, Callable

from ckpt.multihost import process as multihost


class Verdict(enum.Enum):
  """What one process posts of its part of a call (its ``value``)."""
  OK = "ok"
  ERROR = "error"
  CORRUPT = "corrupt"


def encode(value: Any) -> str:
  return json.dumps(value)


def decode(text: str) -> Any:
  return json.loads(text)


def agree(key: str, post: Any, decide: Callable[[dict[int, Any]], Any], *,
          timeout_s: float, what: str) -> Any:
  """``multihost.agree`` over typed values: every process posts ``post``
  (JSON-able); process 0's ``decide({process: post})`` is what every
  process gets back."""
  def decide_text(posts: dict[int, str]) -> str:
    return encode(decide({p: decode(v) for p, v in sorted(posts.items())}))
  return decode(multihost.agree(key, encode(post), decide_text,
                                timeout_s=timeout_s, what=what))


def failure_of(fn: Callable[[], Any]) -> BaseException | None:
  """Runs ``fn`` (this process's own checks before a round); its failure,
  returned so that it joins the round (None if it passed)."""
  try:
    fn()
  except Exception as e:  # pylint: disable=broad-except
    return e
  return None


def describe(error: BaseException | None) -> str | None:
  """What a process posts of its own failure in a round."""
  return None if error is None else f"{type(error).__name__}: {error}"[:2000]


def check_step(step: Any) -> int:
  given = step
  try:
    step = operator.index(step)
  except TypeError:
    step = -1
  if step < 0:
    raise ValueError(f"step must be a non-negative int, got {given!r}")
  return step


def refusal(step: int, newer: list[int], where: str) -> str:
  """The message of a refused save of ``step``, lower than the committed
  ``newer`` steps (``where``: in which directory or tier); the same for a
  Checkpointer and both tiers of a MultiTierCheckpointer."""
  shown = newer if len(newer) <= 20 else [*newer[:10], "...", *newer[-10:]]
  return (
      f"cannot save step {step}: newer committed step(s) {shown} exist "
      f"({where}). A save of an older step would start a new timeline while "
      "the newer steps stay, and latest_step()/restore() (a restarted job) "
      "would resume them. To roll back deliberately, call delete(s) for each "
      f"of {shown} (collective), then save step {step} again. Nothing was "
      "written.")
