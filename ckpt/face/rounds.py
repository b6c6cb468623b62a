"""The agreement rounds of a Checkpointer, and the bounds of its calls.

``Rounds`` owns what every collective call of a Checkpointer shares: the
base of its coordination keys (named after the directory, so every process
derives the same ones), the bound of a barrier (``barrier_timeout_s``), of a
query and of a save (ckpt/store/deadline.py), and the read round in which
process 0 answers and every process gets the answer (``agreed``).

Posts and decisions of a round are typed: ``agree`` encodes what a process
posts and what process 0 decides once, each side a plain dict; ``Verdict``
names what a process found (ok, failed, found corrupt data). ``failure_of``
is the one way a process's own failure joins a round: it is returned, not
raised, so the process still posts it and every process raises together.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import operator
from typing import Any, Callable

from ckpt.multihost import agreement
from ckpt.multihost import process as multihost
from ckpt.store import deadline as deadline_lib


@dataclasses.dataclass(frozen=True)
class Timeouts:
  """The bounds of a Checkpointer's calls (see its docstring)."""
  barrier_s: float
  save_s: float | None
  query_s: float | None

  @classmethod
  def of(cls, barrier_timeout_s, save_timeout_s, query_timeout_s
         ) -> "Timeouts":
    return cls(barrier_timeout_s,
               deadline_lib.check_bound("save_timeout_s", save_timeout_s),
               deadline_lib.check_bound("query_timeout_s", query_timeout_s))

  def query_deadline(self) -> deadline_lib.Deadline | None:
    """The deadline of a query, from now; the store call in flight names
    the operation ("listing the steps of 's3://...'")."""
    return deadline_lib.Deadline.start(self.query_s, "query_timeout_s")


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


class Rounds:
  """The keys, bounds and read rounds of one Checkpointer's directory."""

  def __init__(self, spec: dict, url: str, timeouts: Timeouts):
    # Coordination keys name the directory, so every process derives the
    # same ones from what it was given (see multihost.call_key).
    self.key_base = "dir-" + hashlib.sha1(json.dumps(
        spec, sort_keys=True).encode()).hexdigest()[:16]
    self.url = url
    self.timeouts = timeouts

  @property
  def barrier_s(self) -> float:
    return self.timeouts.barrier_s

  def key(self, *parts) -> str:
    """The key of this process's next call named ``parts``; the same on
    every process (multihost.call_key)."""
    return multihost.call_key(self.key_base, *parts)

  def read_key(self) -> str:
    """The key of the next read round (restore, the queries); taken before
    anything of the call can fail."""
    return self.key("read")

  def agree(self, key: str, post: Any, decide: Callable[[dict], Any],
            what: str) -> Any:
    """``agree`` within ``barrier_timeout_s``."""
    return agree(key, post, decide, timeout_s=self.barrier_s, what=what)

  def local(self, answer: Callable[[], Any]) -> Any:
    """``answer()`` on this process alone, within ``query_timeout_s``."""
    return deadline_lib.call(self.timeouts.query_deadline(), answer)

  def agreed(self, request: str, answer: Callable[[], Any], what: str,
             where: str = "", *, key: str | None = None,
             error: BaseException | None = None) -> Any:
    """``answer()`` computed once by process 0, within the query bound
    (``query_timeout_s``); every process gets it.

    The call's key is taken before anything of the call can fail (``key``:
    taken by the caller already). ``error``: this process's own checks
    failed (a closed Checkpointer, a bad argument or path); the failure
    joins the round, so every process raises and later calls keep their
    keys (agreement.read_round)."""
    if key is None:
      key = self.read_key()
    return agreement.read_round(
        key, request, lambda: self.local(answer), timeout_s=self.barrier_s,
        what=what, where=where, local_error=error)

  def save_deadline(self, step: int, doing: str = "writing step {} to"
                    ) -> deadline_lib.Deadline | None:
    """The deadline of saving (or deleting) ``step``, from now."""
    return deadline_lib.Deadline.start(
        self.timeouts.save_s, "save_timeout_s",
        f"{doing.format(step)} {self.url!r}")

  def read_deadline(self, url: str, what: str
                    ) -> deadline_lib.Deadline | None:
    """The bound of a restore's reads of ``what`` ("step 5") from ``url``:
    ``query_timeout_s`` without progress (ckpt/store/deadline.py), however
    long the reads take."""
    return deadline_lib.Deadline.start(
        self.timeouts.query_s, "query_timeout_s",
        f"reading {what} from {url!r}")
