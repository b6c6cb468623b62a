"""Which tier and which step a multi-tier restore takes
(ckpt/tiers/multitier.py, ckpt/tiers/restoring.py): every process
posts the local steps it can serve for the target, process 0 compares the
newest step the job can rebuild from the local tier with the persistent
tier's newest (or the step asked for), and every process gets the same
decision; restore options the local tier does not take choose among the
persistent tier's steps only (``_persistent_only``).
"""

from __future__ import annotations

from ckpt.checkpointer import Checkpointer
from ckpt.multihost import posts as posts_lib
from ckpt.multihost import process as multihost
from ckpt.tiers import timeline as tier_timeline
from ckpt.errors import CheckpointError
from ckpt.tiers.local_tier import LocalTier


def choose(persistent: Checkpointer, local: LocalTier, step: int | None,
           target_leaves, persistent_only: str = "") -> dict:
  """Collective: process 0 picks the tier and the step; all get it.

  The key is taken first, and a process whose local checks fail (its
  last local save failed, an unreadable manifest) says so in the round:
  it holds no local step, so every process takes the same decision.
  ``persistent_only``: the restore options the local tier does not take
  (then only the persistent tier's steps can be chosen)."""
  key = local.call_key("choose")
  try:  # a collective round of the persistent tier, on every process
    p_steps = persistent_steps(persistent)
  except CheckpointError:
    p_steps = []
  p_latest = p_steps[-1] if p_steps else None

  def verify(s: int) -> bool:
    """The steps that can be chosen have their checksums verified here,
    before the round, so a bad file changes every process's decision."""
    if persistent_only:
      return False  # none can be chosen
    if step is not None:
      return s == step
    return p_latest is None or s >= p_latest

  held: list[int] = []
  try:
    local.wait()
    held = local.committed_steps()
    if target_leaves is None:
      usable = {"own": [], "partner": [], "why": "no target was given "
                "(the local tier restores onto the target's shardings)"}
    else:
      usable = local.usable(target_leaves, verify)
  except Exception as e:  # pylint: disable=broad-except
    usable = {"own": [], "partner": [], "why": (
        f"the local tier failed on process {multihost.process_index()}: "
        f"{type(e).__name__}: {e}")[:1000]}
  dst = local.layout.dst
  n = local.layout.n

  def decide(got: dict[int, dict]) -> dict:
    out = _decide(got)
    # The local steps some process holds (those a resume passes over are
    # named in its warning), and the first reason one was not usable.
    out["held"] = sorted(set().union(*(g["held"] for g in got.values())))
    out["first_why"] = next((f"process {p}: {got[p]['why']}" for p in
                             sorted(got) if got[p]["why"]), "")[:1000]
    return out

  def _decide(got: dict[int, dict]) -> dict:
    complete = tier_timeline.complete(got, dst, n)
    if persistent_only:
      return _persistent_only(step, complete, p_steps, persistent_only,
                              persistent.storage.url)
    if step is not None:
      complete = [s for s in complete if s == step]
    why = "; ".join(sorted({f"process {p}: {g['why']}" for p, g in
                            got.items() if g["why"]}))[:2000]
    if complete and (step is not None or p_latest is None or
                     complete[0] >= p_latest):
      s = complete[0]
      need = [p for p in range(n) if s not in got[p]["own"]]
      reason = (f"process(es) {need} restore step {s} from their partners' "
                "replicas" if need else "")
      if why and need:
        reason += f" ({why})"
      return {"tier": "local", "step": s, "need": need, "reason": reason}
    if complete:
      reason = (f"the newest persistent step {p_latest} is newer than the "
                f"newest step the local tier can rebuild ({complete[0]})")
    elif step is not None:
      reason = f"the local tier cannot rebuild step {step}"
    else:
      reason = "the local tier holds no step every process can rebuild"
    if why:
      reason += f" ({why})"
    # The local steps a resume falls back to, newest first, should the
    # persistent tier's newer steps fail verification (they are checked
    # again, as a restore of that step checks them, before one is used).
    older = [s for s in complete if step is None and s < (p_latest or 0)]
    return {"tier": "persistent", "step": step if step is not None
            else p_latest, "reason": reason, "older": older}

  out = posts_lib.agree(
      key, {"own": usable["own"], "partner": usable["partner"],
            "why": usable["why"], "held": held}, decide,
      timeout_s=local.timeout_s, what="the tier and step to restore")
  local.settle_keys(key)  # the keys of the calls before go
  return out


def persistent_steps(persistent: Checkpointer) -> list[int]:
  """Collective: the persistent tier's committed steps (its
  ``all_steps``) but those a resume of this job found damaged and fell
  back past: no query or restore of the job counts them again, as its
  saves do not (the job's one timeline)."""
  damaged = persistent.tier_side.damaged_steps()
  return [s for s in persistent.all_steps() if s not in damaged]


def _persistent_only(step: int | None, complete: list[int],
                     p_steps: list[int], options: str, url: str) -> dict:
  """Process 0, in ``choose``'s round, for restore options the local tier
  does not take: the persistent tier's newest step, or the given one if
  it has it; an error naming both tiers for a step only the local tier
  can rebuild."""
  why = f"restore options the local tier does not take ({options})"
  if step is None:
    reason = why
    if complete and (not p_steps or complete[0] > p_steps[-1]):
      reason += (f"; the local tier's newer step {complete[0]} is not used "
                 "(restore it without these options)")
    return {"tier": "persistent", "reason": reason,
            "step": p_steps[-1] if p_steps else None}
  if step in p_steps or step not in complete:
    return {"tier": "persistent", "step": step, "reason": why}
  return {"tier": "error", "not_found": True, "reason": (
      f"step {step} is in the local tier only, which does not take the "
      f"restore options {options}; the persistent tier {url!r} holds steps "
      f"{p_steps}. Restore step {step} without these options, or one of the "
      "persistent tier's steps with them")}


# Restore options the local tier honours: it verifies every shard's crc32c
# on every restore (so ``verify=True`` holds), and ``read_once`` only
# concerns reads from the persistent tier. Any other option (``transforms``,
# ``fallback_state``, ``lazy=True``, ``path``) is the persistent tier's only.
_LOCAL_OPTIONS = ("verify", "read_once")


def persistent_options(restore_kwargs: dict) -> str:
  """The restore options given that the local tier does not take ('' if
  none): then only the persistent tier's steps can be chosen."""
  return ", ".join(
      f"{k}={v!r}"[:80] for k, v in sorted(restore_kwargs.items())
      if k not in _LOCAL_OPTIONS and not _is_default(k, v))


def _is_default(option: str, value) -> bool:
  """Whether a restore option has its Checkpointer.restore default (then
  the local tier can honour it); an option not known here never does."""
  if option in ("transforms", "lazy"):
    return not value
  return option in ("fallback_state", "path") and value is None
