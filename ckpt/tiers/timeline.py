"""The rollback rules of multi-tier checkpoints (ckpt/tiers/multitier.py;
docs/multi-tier.md): which step a save may write, and ``delete``.

- A save of a step lower than the newest committed step of either tier (the
  persistent tier's, or a local step the job can rebuild) is refused on
  every process before anything is written (``check``, one agreement
  round per save). Saving it would start a new timeline while the newer
  steps stay, and a restart would resume them; ``delete`` each newer step
  first (a deliberate rollback).
- ``delete``: every process renames its local step away (atomic, and
  reversible), then one round in which process 0 deletes the persistent
  step; if anything failed anywhere, every process puts its local step
  back and all raise the same error.
"""

from __future__ import annotations


from absl import logging

from ckpt.checkpointer import Checkpointer
from ckpt.multihost import posts as posts_lib
from ckpt.multihost import process as multihost
from ckpt.errors import (CheckpointError, CheckpointNotFoundError,
                         CorruptCheckpointError)
from ckpt.tiers.local_tier import LocalTier


def check(persistent: Checkpointer, local: LocalTier, step: int,
          prepare=None) -> None:
  """Collective, before a save writes anything: refuses a step lower
  than the newest committed step of either tier, with the same
  CheckpointError on every process. Each process posts its local steps
  above ``step`` (of this run) or its own failure (the previous local
  save's, say, or one of ``prepare()``, the save's own preparation);
  process 0 adds the persistent tier's and decides."""
  key = local.call_key("timeline")
  mine = {"own": [], "partner": [], "dst": [], "n": 0}

  def own_part() -> None:  # what can fail on one process alone
    s = posts_lib.check_step(step)
    if prepare is not None:
      prepare()
    local.wait()  # the previous local save: its failure, its commit
    mine.update(_local_newer(local, s), dst=local.layout.dst,
                n=local.layout.n)
  error = posts_lib.failure_of(own_part)
  dst, n = mine.pop("dst"), mine.pop("n")
  if error is None:
    step = posts_lib.check_step(step)

  def decide(posts: dict[int, dict]) -> dict:
    got, failed = _read_posts(key, posts)
    if failed:
      return {"failed": failed}
    # The local steps a restore could use (as ``choose`` counts them, from
    # the manifests): a step that some process holds but the job cannot
    # rebuild (a host and its partner lost) is never resumed, and goes
    # at this save's retention.
    local_newer = sorted(complete(got, dst, n))
    try:  # but those a resume fell back past (damaged: never resumed)
      persistent_newer = persistent.tier_side.newer_than(
          step, fresh=bool(local_newer))
    except Exception as e:  # pylint: disable=broad-except
      return {"failed": {0: (
          f"listing the persistent tier {persistent.storage.url!r}: "
          f"{type(e).__name__}: {e}")[:2000]}}
    return {"local": local_newer, "persistent": persistent_newer}

  out = posts_lib.agree(
      key, {**mine, "error": posts_lib.describe(error)}, _safe(decide),
      timeout_s=local.timeout_s,
      what=f"whether step {step} can be saved (newer committed steps)")
  if "failed" in out:  # the same error on every process, the failed too
    raise CheckpointError(
        f"saving step {step} was refused before anything was written: it "
        f"failed on process(es) {sorted(int(p) for p in out['failed'])}: "
        + "; ".join(f"process {p}: {m}" for p, m in out["failed"].items())
    ) from error
  if error is not None:
    raise error
  if out["local"] or out["persistent"]:
    where = "; ".join(
        f"in the {tier} tier {url!r}: {steps}" for tier, url, steps in (
            ("persistent", persistent.storage.url, out["persistent"]),
            ("local", local.root, out["local"])) if steps)
    raise CheckpointError(posts_lib.refusal(
        step, sorted(set(out["local"]) | set(out["persistent"])), where))


def _local_newer(local: LocalTier, step: int) -> dict[str, list[int]]:
  """This process's committed local steps above ``step`` with a valid
  manifest of this run: the own parts and partner replicas it holds (as
  ``LocalTier.usable`` counts them, checksums aside); local, no
  collective."""
  lay = local.layout
  out = {"own": [], "partner": []}
  for s in local.committed_steps():
    if s <= step:
      continue
    try:
      m = local.manifest(s)
      why = local.foreign(m)
    except CorruptCheckpointError as e:
      why = str(e)
    if why:  # never restored, removed by the next save
      logging.info("ckpt: local step %d does not count as committed: %s", s,
                   why)
      continue
    out["own"].append(s)
    if lay.n > 1 and m["partner_src"] == lay.src[lay.pid]:
      out["partner"].append(s)
  return out


def delete(persistent: Checkpointer, local: LocalTier, step: int) -> None:
  """MultiTierCheckpointer.delete (see its docstring)."""
  key = local.call_key("delete")
  given, hid = step, []

  def own_part() -> None:  # what can fail on one process alone
    s = posts_lib.check_step(step)
    local.wait()  # a local save in flight commits first
    hid.append(local.hide_step(s))
  error = posts_lib.failure_of(own_part)
  hidden = hid[0] if hid else None
  if error is None:
    step = posts_lib.check_step(step)

  def decide(posts: dict[int, dict]) -> dict:
    got, failed = _read_posts(key, posts)
    if failed:
      return {"failed": failed}
    hidden_on = [p for p, g in got.items() if g["hidden"]]
    try:
      persistent.tier_side.delete_now(step)
      in_persistent = True
    except CheckpointNotFoundError as e:
      in_persistent, why = False, str(e)
    except Exception as e:  # pylint: disable=broad-except
      return {"error": [
          type(e).__name__, f"deleting step {step}: {e}"[:4000]]}
    if not (in_persistent or hidden_on):
      return {"error": ["CheckpointNotFoundError", (
          f"cannot delete step {step}: neither tier holds it ({why}; no "
          f"process holds step_{step} in the local tier "
          f"{local.root!r})")[:4000]]}
    return {"persistent": in_persistent, "local": hidden_on}

  try:
    out = posts_lib.agree(
        key, {"hidden": hidden is not None,
              "error": posts_lib.describe(error)},
        _safe(decide), timeout_s=local.timeout_s,
        what=f"deleting step {given!r}")
  except BaseException:
    if hidden is not None:
      logging.error("ckpt: delete(%s) did not complete: the local step on "
                    "this process stays renamed away (%s) and is removed "
                    "at the next save", given, hidden)
    raise
  if "persistent" not in out:  # refused: every local step goes back
    if hidden is not None:
      try:
        local.unhide_step(step, hidden)
      except OSError as e:
        logging.error("ckpt: could not put local step %d back (%s): %s",
                      step, hidden, e)
    if error is not None:
      raise error
    if "failed" in out:
      raise CheckpointError(
          f"delete({given!r}) failed on process(es) "
          f"{sorted(int(p) for p in out['failed'])}; no tier was changed: "
          + "; ".join(f"process {p}: {m}" for p, m in out["failed"].items()))
    cls = (CheckpointNotFoundError if out["error"][0] ==
           "CheckpointNotFoundError" else CheckpointError)
    raise cls(out["error"][1])
  if hidden is not None:
    local.drop_hidden(hidden)
  logging.info("ckpt: deleted step %d (persistent tier: %s; local tier: "
               "process(es) %s)", step, out["persistent"], out["local"])
  persistent.tier_side.deleted(step)


def complete(got: dict[int, dict], dst: list[int], n: int) -> list[int]:
  """The steps the job can rebuild, newest first: every process ``p`` has
  its own part (``got[p]["own"]``) or its partner ``dst[p]`` holds its
  replica (``got[dst[p]]["partner"]``)."""
  candidates = set()
  for g in got.values():
    candidates |= set(g["own"]) | set(g["partner"])
  return [s for s in sorted(candidates, reverse=True)
          if len(got) == n and all(
              s in got[p]["own"] or (n > 1 and s in got[dst[p]]["partner"])
              for p in range(n))]


def _safe(decide):
  """``decide`` of a round that never raises (process 0 would then leave
  the others waiting): its failure is a decision naming process 0."""
  def safe(posts: dict[int, dict]) -> dict:
    try:
      return decide(posts)
    except Exception as e:  # pylint: disable=broad-except
      return {"failed": {0: (
          f"process 0 could not decide: {type(e).__name__}: {e}")[:2000]}}
  return safe


def _forget_previous(key: str) -> None:
  """In round ``n``'s decision (every process is past its barrier, so all
  read round ``n - 1``'s decision): round ``n - 1``'s keys go."""
  base, _, n = key.rpartition("/")
  if n.isdigit() and int(n) > 0:
    multihost.forget(f"{base}/{int(n) - 1}")


def _read_posts(key: str, got: dict[int, dict]) -> tuple[dict, dict]:
  """Process 0, in a round's decide: the earlier calls' keys go; every
  process's post, and the failures among them."""
  _forget_previous(key)
  return got, {p: g["error"] for p, g in got.items() if g["error"]}
