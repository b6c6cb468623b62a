"""The agreement rounds of a Checkpointer, and the bounds of its calls.

``Rounds`` owns what every collective call of a Checkpointer shares: the
base of its coordination keys (named after the directory, so every process
derives the same ones), the bound of a barrier (``barrier_timeout_s``), of a
query and of a save (ckpt/store/deadline.py), and the read round in which
process 0 answers and every process gets the answer (``agreed``).

Posts and decisions of a round are typed (ckpt/multihost/posts.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Callable

from ckpt.multihost import agreement
from ckpt.multihost import posts as posts_lib
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

  def query_deadline(self, on_wire: bool = True
                     ) -> deadline_lib.Deadline | None:
    """The deadline of a query, from now; the store call in flight names
    the operation ("listing the steps of 's3://...'"). ``on_wire=False``:
    its store is a local disk (ckpt/store/traffic.py)."""
    return deadline_lib.Deadline.start(self.query_s, "query_timeout_s",
                                       on_wire=on_wire)


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
    return posts_lib.agree(key, post, decide, timeout_s=self.barrier_s,
                           what=what)

  def local(self, answer: Callable[[], Any]) -> Any:
    """``answer()`` on this process alone, within ``query_timeout_s``."""
    return deadline_lib.call(
        self.timeouts.query_deadline(_remote(self.url)), answer)

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
        f"{doing.format(step)} {self.url!r}", on_wire=_remote(self.url))

  def read_deadline(self, url: str, what: str
                    ) -> deadline_lib.Deadline | None:
    """The bound of a restore's reads of ``what`` ("step 5") from ``url``:
    ``query_timeout_s`` without progress (ckpt/store/deadline.py), however
    long the reads take."""
    return deadline_lib.Deadline.start(
        self.timeouts.query_s, "query_timeout_s",
        f"reading {what} from {url!r}", on_wire=_remote(url))


def _remote(url: str) -> bool:
  """Whether ``url``'s store is reached over the network (its bytes in
  flight count as progress: ckpt/store/traffic.py)."""
  return not url.startswith(("file://", "/", "memory://"))
