"""Decisions a multi-process job makes once, on process 0, and every process follows.

Every collective call of a Checkpointer starts with one round
(``multihost.agree``): each process posts what it knows, process 0 decides,
every process gets the same decision. Nothing else a process sees on its own
(its listing of the directory, its own failure) can steer it away from the
others.

- save: all processes save into the work directory process 0 prepared, or
  all skip (the step is committed), or all raise the same error naming the
  processes that failed before writing anything and why. Values that must be
  equal on every process (host numpy leaves saved without a partitioner,
  inline values) are compared here by digest, before anything is written.
- reads (restore, latest_step, all_steps, metrics, host_state): process 0
  lists the directory once and every process gets its answer; processes
  that ask different things (step 5 on one, step 6 on another) all raise.

Keys come from ``multihost.call_key`` (directory, operation, step, and the
number of that call), never from a counter that a failure could shift.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import msgpack
import numpy as np

from ckpt import errors
from ckpt.format import extras as save_extras
from ckpt.multihost import process as multihost
from ckpt.format import tree
from ckpt.format.crc import checksum
from ckpt.format import entries
from ckpt.format import inline_values
from ckpt.shards import tiling as tiling_lib

# Digests one process posts about its host values: at most this many, each
# over a group of consecutive leaves, so a post stays small at any leaf count.
MAX_DIGESTS = 256
# Errors are re-raised on every process as the class the failing process
# raised, when it is one of ckpt's (MissingLeavesError takes no message).
_ERRORS = {c.__name__: c for c in (
    errors.CheckpointError, errors.CheckpointNotFoundError,
    errors.CorruptCheckpointError, errors.TreeMismatchError,
    errors.InvalidStateError, errors.BarrierTimeoutError,
    errors.StoreTimeoutError)}
_ERRORS["MissingLeavesError"] = errors.TreeMismatchError


@dataclasses.dataclass(frozen=True)
class Decision:
  """What every process does: ``action`` is "save", "skip", "value",
  "local" (each process answers for itself) or "error"."""
  action: str
  token: str = ""            # "save": the attempt process 0 prepared
  value: Any = None          # "value": the answer of a read round
  error_type: str = ""       # "error": the class to raise ...
  message: str = ""          # ... and its message

  def encode(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def decode(cls, text: str) -> "Decision":
    return cls(**json.loads(text))

  def raise_error(self, local: BaseException | None = None) -> None:
    """Raises the agreed error (chained to this process's own, if any)."""
    cls = _ERRORS.get(self.error_type, errors.CheckpointError)
    raise cls(self.message) from local


def _error_decision(e: BaseException, message: str) -> Decision:
  name = type(e).__name__ if type(e).__name__ in _ERRORS else "CheckpointError"
  return Decision("error", error_type=name, message=message)


# ---- host values that every process must agree on --------------------------

def host_values(leaves) -> list[tuple[str, int]]:
  """(leaf path, crc32c) of each value saved once for the whole job from
  each process's own copy: inline values, and host numpy arrays with no
  partitioner sharding (``host_replicated``)."""
  out = []
  for lp in leaves:
    if isinstance(lp.entry, entries.ValueEntry):
      data = msgpack.packb(inline_values.encode_value(lp.entry.value, lp.parts),
                           use_bin_type=True)
    elif isinstance(lp.source, np.ndarray) and lp.host_replicated:
      data = lp.source
    else:
      continue
    out.append((tree.path_str(lp.parts), checksum(data)))
  return out


def _groups(values: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
  size = max(1, -(-len(values) // MAX_DIGESTS))
  return [values[i:i + size] for i in range(0, len(values), size)]


def digests(values: list[tuple[str, int]]) -> list[int]:
  return [checksum(json.dumps(g).encode()) for g in _groups(values)]


def _host_mismatch(mine: list[tuple[str, int]], theirs: dict[int, list[int]]
                   ) -> str | None:
  """Process 0: which leaves differ on which processes, or None."""
  groups, own = _groups(mine), digests(mine)
  differs: dict[int, list[int]] = {}   # group -> processes
  for p, d in sorted(theirs.items()):
    if len(d) != len(own):
      differs.setdefault(0, []).append(p)
      continue
    for g, (a, b) in enumerate(zip(own, d)):
      if a != b:
        differs.setdefault(g, []).append(p)
  if not differs:
    return None
  parts = []
  for g, procs in sorted(differs.items())[:5]:
    names = [n for n, _ in groups[g]] if groups else []
    what = (f"leaf {names[0]!r}" if len(names) == 1 else
            f"one of the leaves {names[:8]}{' ...' if len(names) > 8 else ''}")
    parts.append(f"{what} differs between process 0 and process(es) {procs}")
  return ("; ".join(parts) + ". Host numpy leaves saved without a "
          "partitioner, and inline values (scalars, strings, small arrays), "
          "are saved once for the whole job, so every process must hold the "
          "same value. Pass per-process values (data-loader positions, RNG "
          "state) as save(..., host_state=...), or give a partitioner that "
          "says which slice each process owns")


# ---- the save round ---------------------------------------------------------

class SaveRefused(errors.CheckpointError):
  """Raised by a save round's ``prepare`` (process 0) to refuse the save
  from agreed facts (a newer committed step): every process raises a
  ``CheckpointError`` with exactly this message, before anything is
  written."""


class PostMemory:
  """What the processes posted in the last save round of one directory
  that decided "save", remembered so that a later round costs a process
  with the same post no key-value set (each call of each process is one
  more for the coordination service that process 0 runs:
  docs/at-scale.md#process-0-per-process). Module-level, by the
  directory's key base, as ``multihost.call_key``'s counts are: the rounds
  of every Checkpointer of one directory are one sequence.

  The rule that keeps both sides the same: a process remembers its post
  (``sent``) only once it received the "save" decision of the round it
  posted it in, and forgets it when any round of the directory ends
  otherwise on it (another decision, or a failure: it may have missed the
  decision); process 0 remembers every process's post (``posts``) when it
  decides "save", and forgets them when it decides anything else. So a
  process that skips its post (its post is its ``sent``) finds process 0
  holding that very post; a process 0 that holds none for a process that
  did not post (it restarted) refuses the save, naming it, and the next
  round posts in full."""

  def __init__(self):
    self.sent: dict[str, str] = {}
    self.posts: dict[str, dict[int, str]] = {}


_memory = PostMemory()


def save_round(key: str, step: int, local_error: BaseException | None,
               values: list[tuple[str, int]], prepare: Callable[[], str | None],
               *, timeout_s: float, host_claim: list | None = None,
               tiling: Any = None, memory: str | None = None) -> Decision:
  """Every process: save (token), skip, or raise together.

  ``prepare`` runs on process 0 only, once every process is ready: it
  returns the attempt token of a prepared work directory, or None when the
  step is already committed. ``host_claim``: this process's host_state
  claim (extras.host_state_files); a "save" decision's ``value`` is the
  number of host_state files the step holds (extras.host_state_count).
  ``tiling``: ``(mine, whole)``, the digest of the boxes this process's
  plan writes and (used on process 0) that of every array tiled once
  (ckpt/shards/tiling.py): process 0 refuses the save, before anything is
  written, unless the processes' digests add up to the whole. Posted in
  this round, which every process joins anyway, so checking the tiling
  costs no call of its own (a call per process is what the coordination
  service, which process 0 runs, pays for: docs/at-scale.md).
  ``memory``: the directory's key base; a process whose post is the one
  it posted in the directory's last round decided "save" only arrives at
  the round's barrier (``PostMemory``).
  """
  err = None
  if local_error is not None:
    err = [type(local_error).__name__, f"{type(local_error).__name__}: {local_error}"]
  post = json.dumps({"error": err, "host": digests(values),
                     "hs": host_claim or ["own", False],
                     "tiling": None if tiling is None else list(tiling[0])})

  def decide(posts: dict[int, str]) -> str:
    known = _memory.posts.pop(memory, {}) if memory is not None else {}
    missing = [p for p in range(multihost.process_count())
               if p not in posts and p not in known]
    if missing:
      return Decision("error", error_type="CheckpointError", message=(
          f"saving step {step}: process(es) {missing[:8]} sent no post to "
          "the save round and process 0 holds none of theirs (process 0 "
          "restarted since their last save?); refused before anything was "
          "written: the next save posts in full")).encode()
    posts = {p: posts.get(p, known.get(p)) for p in
             range(multihost.process_count())}
    out = _decide(posts)
    if memory is not None and Decision.decode(out).action == "save":
      _memory.posts[memory] = posts
    return out

  def _decide(posts: dict[int, str]) -> str:
    try:
      got = {p: json.loads(v) for p, v in posts.items()}
      failed = {p: g["error"] for p, g in sorted(got.items()) if g["error"]}
      if failed:
        first = next(iter(failed.values()))[0]
        name = first if first in _ERRORS else "CheckpointError"
        shown = "; ".join(f"process {p}: {m[1]}" for p, m in list(failed.items())[:8])
        more = f" (and {len(failed) - 8} more)" if len(failed) > 8 else ""
        return Decision("error", error_type=name, message=(
            f"saving step {step} was refused before anything was written: "
            f"{len(failed)} of {len(got)} process(es) failed to prepare it: "
            f"{shown}{more}")).encode()
      mismatch = _host_mismatch(values, {p: g["host"] for p, g in got.items()
                                         if p != 0})
      if mismatch:
        return Decision("error", error_type="InvalidStateError", message=(
            f"saving step {step}: {mismatch}")).encode()
      if tiling is not None and (wrong := _tiling_wrong(
          step, tiling[1], [g.get("tiling") for g in got.values()])):
        return Decision("error", error_type="CheckpointError",
                        message=wrong).encode()
      try:
        count = save_extras.host_state_count(
            {p: g.get("hs") for p, g in got.items()}, len(got))
      except errors.InvalidStateError as e:
        return Decision("error", error_type="InvalidStateError", message=(
            f"saving step {step}: {e}")).encode()
      token = prepare()
      return (Decision("skip") if token is None else
              Decision("save", token=token, value=count)).encode()
    except SaveRefused as e:
      return Decision("error", error_type="CheckpointError",
                      message=str(e)).encode()
    except Exception as e:  # pylint: disable=broad-except
      return _error_decision(e, (
          f"saving step {step}: process 0 could not prepare it: "
          f"{type(e).__name__}: {e}")).encode()

  mine = memory  # (one process posts to itself: nothing to skip)
  if not multihost.is_multiprocess():
    if local_error is not None:
      raise local_error  # one process: its own error, as it is
    mine = None
  sent = _memory.sent.pop(mine, None) if mine is not None else None
  try:
    decision = Decision.decode(multihost.agree(
        f"{key}/start", None if sent == post else post, decide,
        timeout_s=timeout_s, what=f"the start of the save of step {step}"))
  except BaseException:
    if memory is not None and multihost.process_index() == 0:
      _memory.posts.pop(memory, None)
    raise
  if mine is not None and decision.action == "save":
    _memory.sent[mine] = post
  if decision.action == "error":
    if not multihost.is_multiprocess():
      # Process 0's own failure to prepare: raise it with its own type.
      raise _ERRORS.get(decision.error_type, errors.CheckpointError)(
          decision.message)
    decision.raise_error(local_error)
  return decision


def _tiling_wrong(step: int, whole: Any, posted: list) -> str | None:
  """Process 0: why the boxes the processes plan to write do not tile
  every array exactly once (ckpt/shards/tiling.py), or None. O(processes)
  integer additions: the digests are three numbers each."""
  try:
    got = tiling_lib.combine((int(a), int(b), int(c)) for a, b, c in posted)
  except (TypeError, ValueError):
    got = None  # a process posted none: it runs a different ckpt
  if got is not None and got == tuple(whole):
    return None
  return (f"saving step {step}: the boxes the {len(posted)} processes plan "
          "to write do not cover every array exactly once (a part written "
          "by no process, or twice): the processes planned differently "
          "(hosts running different ckpt versions, or a different view of "
          "the mesh?); refused before anything was written (digest "
          f"{list(got) if got else None}, expected {list(whole)})")


# ---- the outcome of a restore ----------------------------------------------

def outcome_round(key: str, error: BaseException | None, what: str, *,
                  timeout_s: float) -> None:
  """After a restore's reads: every process says how its part ended; if
  any failed, every process raises, the same class with the same message
  naming each failed process and its error (the chunk a crc32c mismatch
  names), instead of the others returning while it raises (and then
  waiting in their next collective for a process that never comes).

  The class is CorruptCheckpointError if any process found damaged data,
  else the first failed process's if it is one of ckpt's, else
  CheckpointError; the failed process's own error is its ``__cause__``. A
  process whose own error is not a ckpt error (its own code raised in a
  transform) re-raises it as it is. A process whose error only relays
  another's (``relayed_from``: an earlier round of the same restore) is not
  named as failed when the one it relays is. When every process failed
  with the same error (a target that does not fit the checkpoint), each
  raises its own, as it is."""
  post = None
  if error is not None:
    post = [type(error).__name__, str(error)[:2000],
            isinstance(error, errors.CorruptCheckpointError) or
            "CorruptCheckpointError" in str(error)[:2000],
            getattr(error, "relayed_from", None) is not None]

  def decide(got: dict[int, Any]) -> dict:
    failed = {p: g for p, g in sorted(got.items()) if g is not None}
    if not failed:
      return {}
    if len(failed) == len(got) and len({(g[0], g[1]) for g in
                                        failed.values()}) == 1:
      return {"own": True}  # the same error everywhere: each raises its own
    own = {p: g for p, g in failed.items() if not g[3]} or failed
    first = next(iter(own.values()))[0]
    name = ("CorruptCheckpointError" if any(g[2] for g in failed.values())
            else first if first in _ERRORS else "CheckpointError")
    if len(own) == 1:
      (p, g), = own.items()
      said = f"process {p} of {len(got)}: {g[0]}: {g[1]}"
    else:
      shown = "; ".join(f"process {p}: {g[0]}: {g[1]}"
                        for p, g in list(own.items())[:8])
      more = f" (and {len(own) - 8} more)" if len(own) > 8 else ""
      said = f"processes {sorted(own)} of {len(got)}: {shown}{more}"
    return {"type": name, "message": f"{what} failed on {said}"}

  if not multihost.is_multiprocess():
    if error is not None:
      raise error
    return
  out = json.loads(multihost.agree(
      key, json.dumps(post), lambda posts: json.dumps(decide(
          {p: json.loads(v) for p, v in posts.items()})),
      timeout_s=timeout_s, what=f"the outcome of the {what}"))
  if not out or out.get("own"):
    if error is not None:  # (none and no decision: it posted no failure)
      raise error
    return
  if error is not None and not isinstance(error, errors.CheckpointError):
    raise error  # its own code's error, as it is; the others name it
  raise _ERRORS.get(out["type"], errors.CheckpointError)(
      out["message"]) from error


# ---- read rounds ------------------------------------------------------------

def read_round(key: str, request: str, answer: Callable[[], Any], *,
               timeout_s: float, what: str, where: str = "",
               local_error: BaseException | None = None) -> Any:
  """Process 0 computes ``answer()`` (JSON-able) once; every process gets it.

  ``request`` says what this process asked for; if processes ask different
  things, all raise, naming them. ``where`` is a location that may differ
  between processes (``restore(path=...)`` of per-host copies): if it does,
  every process computes ``answer()`` itself. ``local_error``: this process
  failed before the round (a bad argument, a path it cannot open); it still
  takes part, so that every process raises (the failing one its own error,
  the others one naming it) and no key of a later call drifts.
  """
  if not multihost.is_multiprocess():
    if local_error is not None:
      raise local_error
    return answer()
  err = (None if local_error is None else
         f"{type(local_error).__name__}: {local_error}"[:2000])

  def decide(raw: dict[int, str]) -> str:
    # Every process has passed this round's barrier, so all have read the
    # previous round's decision: its keys can go.
    base, _, n = key.rpartition("/")
    if n.isdigit() and int(n) > 0:
      multihost.forget(f"{base}/{int(n) - 1}")
    got = {p: json.loads(v) for p, v in raw.items()}
    failed = {p: g[2] for p, g in sorted(got.items()) if g[2]}
    if failed:
      shown = "; ".join(f"process {p}: {m}" for p, m in
                        list(failed.items())[:8])
      return Decision("error", error_type="CheckpointError", message=(
          f"{what} failed on process(es) {sorted(failed)} before the "
          f"processes agreed: {shown}")).encode()
    posts = {p: g[0] for p, g in got.items()}
    if len({json.dumps(g[1]) for g in got.values()}) > 1:
      return Decision("local").encode()
    differ = {p: r for p, r in posts.items() if r != posts.get(0)}
    if differ:
      shown = ", ".join(f"process {p}: {r}" for p, r in sorted(differ.items())[:8])
      return Decision("error", error_type="CheckpointError", message=(
          f"processes asked for different things in {what}: process 0: "
          f"{posts.get(0)}; {shown}. Every process must make the same "
          "Checkpointer calls with the same arguments")).encode()
    try:
      return Decision("value", value=answer()).encode()
    except Exception as e:  # pylint: disable=broad-except
      return _error_decision(e, str(e)).encode()

  decision = Decision.decode(multihost.agree(
      key, json.dumps([request, where, err]), decide, timeout_s=timeout_s,
      what=what))
  if local_error is not None:
    raise local_error
  if decision.action == "error":
    decision.raise_error()
  if decision.action == "local":
    return answer()
  return decision.value
