"""The queries of ``MultiTierCheckpointer`` (ckpt/tiers/multitier.py) that
look at both tiers: ``all_steps``, the steps the job can restore, with the
meaning of ``Checkpointer.all_steps`` (committed steps, increasing).

A step counts when the persistent tier has committed it, or when the local
tier can rebuild it: every process holds its own part of it, or its
partner holds a replica (ckpt/tiers/timeline.py ``complete``), read from
the manifests of this run. The local steps at or above the persistent
tier's newest have their files' sizes and crc32c verified first, as
``latest_step()`` verifies them: so ``all_steps()[-1] == latest_step()``.
Older local steps are listed from their manifests (a restore of one
verifies it then).
"""

from __future__ import annotations

from ckpt.checkpointer import Checkpointer
from ckpt.multihost import posts as posts_lib
from ckpt.multihost import process as multihost
from ckpt.tiers import choice as tier_choice
from ckpt.tiers import timeline as tier_timeline
from ckpt.tiers.local_tier import LocalTier


def all_steps(persistent: Checkpointer, local: LocalTier) -> list[int]:
  """Collective: the persistent tier's committed steps (its own round)
  and the local steps the job can rebuild (one round: every process posts
  the local steps it can serve, process 0 keeps those every process can
  get back), merged, in increasing order, the same on every process."""
  p_steps = tier_choice.persistent_steps(persistent)
  p_latest = p_steps[-1] if p_steps else None
  key = local.call_key("all_steps")
  try:
    local.wait()  # a local save in flight commits first
    usable = local.usable(
        [], lambda s: p_latest is None or s >= p_latest)
  except Exception as e:  # pylint: disable=broad-except
    # This process serves no local step; the others still agree with it.
    usable = {"own": [], "partner": [], "why": (
        f"the local tier failed on process {multihost.process_index()}: "
        f"{type(e).__name__}: {e}")[:1000]}
  dst, n = local.layout.dst, local.layout.n

  def decide(got: dict[int, dict]) -> list[int]:
    return tier_timeline.complete(got, dst, n)

  rebuilt = posts_lib.agree(
      key, {"own": usable["own"], "partner": usable["partner"]}, decide,
      timeout_s=local.timeout_s,
      what="the steps of both tiers (all_steps)")
  local.settle_keys(key)
  return sorted(set(p_steps) | set(rebuilt))
