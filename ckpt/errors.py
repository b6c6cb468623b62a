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
  """Target leaves that neither the checkpoint nor a fallback provide.

  ``target``: every leaf path of the target. When the target's top level
  misses a key of the checkpoint and the missing leaves are there one level
  down (or up), the message says the structures differ at the top, with
  both key sets and the target that fits, rather than to pass
  ``fallback_state`` (the leaves are in the checkpoint, under another
  path)."""

  def __init__(self, missing: list[str], available: list[str],
               target: list[str] = ()):
    self.missing = list(missing)
    top = _top_level_mismatch(self.missing, list(available), list(target))
    if top is not None:
      super().__init__(top)
      return
    super().__init__(
        f"{len(missing)} target leaves are missing from the checkpoint: "
        f"{', '.join(missing)}. {_did_you_mean(self.missing, available)}"
        f"The checkpoint has: {_shown(available)}. Pass "
        "fallback_state= or a restore transform that provides them."
    )


def _did_you_mean(missing: list[str], available: list[str]) -> str:
  """'Did you mean ...?' for each top-level key of the missing leaves
  that the checkpoint lacks and that is close to one it has (a misspelt
  key: "parms" for "params"); '' if none is."""
  import difflib  # pylint: disable=g-import-not-at-top
  have = sorted({n.split("/", 1)[0] for n in available})
  guesses = []
  for key in sorted({m.split("/", 1)[0] for m in missing} - set(have)):
    close = difflib.get_close_matches(key, have, n=1, cutoff=0.6)
    if close:
      guesses.append(f"{close[0]!r} for the target's {key!r}")
  return f"Did you mean {', '.join(guesses[:5])} (a top-level key)? " if (
      guesses) else ""


def _shown(names, n: int = 20) -> str:
  names = sorted(names)
  more = "" if len(names) <= n else f", ... ({len(names)} in all)"
  return f"[{', '.join(names[:n])}{more}]"


def _top_level_mismatch(missing: list[str], available: list[str],
                        target: list[str]) -> str | None:
  """The message for a target whose top level is not the checkpoint's
  (``{...}`` for a checkpoint of ``{"state": {...}}``, or the reverse), or
  None: the checkpoint's top level has a key the target's lacks, no missing
  leaf is under a top-level key of the checkpoint, and the missing leaves
  are in the checkpoint one level down (or the whole target is one level
  down), or the two top levels share no key. Cost: about linear in the
  leaves (set lookups, no pairwise search)."""
  def top(name: str) -> str:
    return name.split("/", 1)[0]
  have, want = {top(n) for n in available}, {top(n) for n in target}
  if not missing or not have - want or any(top(m) in have for m in missing):
    return None
  saved = set(available)
  # The checkpoint holds them one level down: under one of its keys.
  under = {p for p in have - want if f"{p}/{missing[0]}" in saved}
  for m in missing[1:]:
    under = {p for p in under if f"{p}/{m}" in saved}
  # The target nests them one level down: all of it under one key (not a
  # new key beside the saved ones, such as an EMA copy of the params).
  nest = (next(iter(want)) if len(want) == 1 and all(
      "/" in m and m.split("/", 1)[1] in saved for m in missing) else None)
  if under:
    p = min(under)
    fix = (f"the checkpoint holds the missing leaves one level down, under "
           f"{p!r} ({missing[0]!r} is saved as '{p}/{missing[0]}'): restore "
           f"with target={{{p!r}: <this target>}} and take [{p!r}] of the "
           "result")
  elif nest is not None:
    rest = missing[0].split("/", 1)[1]
    fix = (f"the target nests the checkpoint's leaves one level down, under "
           f"{nest!r} ({missing[0]!r} is saved as {rest!r}): restore with "
           f"target=<this target>[{nest!r}] and put the result back under "
           f"{nest!r}")
  elif not have & want:
    fix = ("pass a target of the checkpoint's structure (ckptr.metadata("
           "step).tree shows it), or a restore transform that renames its "
           "leaves")
  else:
    return None
  return (f"the target's structure differs from the checkpoint's at the top "
          f"level: the target has top-level keys {_shown(want)}, the "
          f"checkpoint {_shown(have)}, so {len(missing)} target leaves are "
          f"not in the checkpoint (e.g. {missing[0]!r}); {fix}. "
          "(fallback_state= is for leaves the checkpoint does not have; "
          "these are in it under another path.)")


class InvalidStateError(CheckpointError, TypeError):
  """A state handed to save() holds something ckpt cannot store."""


class BarrierTimeoutError(CheckpointError, TimeoutError):
  """Not every process reached a barrier within the timeout."""


class StoreTimeoutError(CheckpointError, TimeoutError):
  """An operation on a store went longer than its bound without progress
  (``save_timeout_s``, ``query_timeout_s``; see docs/multi-host.md). The
  message names the operation, the URL, how long it stalled, the bound and
  the option."""
  deadline = None  # the ckpt.store.deadline.Deadline it ran past
  doing = None     # the store call it was waiting for, when known


class WaitTimeoutError(CheckpointError, TimeoutError):
  """``wait_until_finished(timeout=...)`` ran out of time; the save it waited
  for is still tracked (the next wait, save or close waits for it again)."""
