"""``ckpt gc``: what a retention policy drops, abandoned saves past a minimum age, and (only
when asked) incomplete step directories, said as a dry run or deleted with ``--yes`` through
the same removal a writer uses.
"""

from __future__ import annotations

import time

from ckpt.commit import cleanup as cleanup_lib
from ckpt.cli.listing import list_entries, open_root
from ckpt.cli.output import Progress, emit, human_age, human_bytes
from ckpt.cli.usage import EXIT_OK, UsageError
from ckpt.commit import deletion
from ckpt.commit import lease as lease_lib
from ckpt.store import storage as storage_lib
from ckpt.errors import CheckpointError
from ckpt.commit.retention import RetentionPolicy
from ckpt.store import names
from ckpt.commit import rename

DEFAULT_TMP_MIN_AGE_S = 3600


def _watch(storage: storage_lib.Storage, args, tmp: list
           ) -> tuple[set, float] | None:
  """A bucket's uncommitted attempts have no age gc can read (no host's
  clock is trusted: ckpt/commit/lease.py): gc watches their leases for
  ``min(--tmp-min-age, --lease-s)`` seconds. Returns (the names that did
  not change meanwhile, or whose holder is provably dead, and unfinished
  deletions; the seconds watched); None on a disk or with nothing to
  watch (or --tmp-min-age 0: every uncommitted attempt goes)."""
  if storage.is_posix or not tmp or args.tmp_min_age <= 0:
    return None
  window = float(min(args.tmp_min_age, args.lease_s))
  seen = lease_lib.Sightings()
  cleanup_lib.abandoned(storage, window, None, seen)  # first sight
  if window > 0:
    time.sleep(window)
  return set(cleanup_lib.abandoned(storage, window, None, seen)), window


def cmd_gc(args) -> int:
  if args.best_metric is not None and args.keep is None:
    raise UsageError("--best-metric needs --keep N (how many best to keep)")
  policy = RetentionPolicy(
      keep=args.keep, keep_period=args.keep_period,
      best_metric=args.best_metric, best_mode=args.best_mode,
      keep_checkpoints_without_metrics=args.keep_checkpoints_without_metrics)
  storage = open_root(args, args.dir)
  rows = list_entries(storage)
  by_name = {r["name"]: r for r in rows}
  committed = [r for r in rows if r["status"] in ("committed", "corrupt")]
  bad = [r for r in committed if r["status"] == "corrupt"]
  if bad and policy.best_metric is not None:
    raise CheckpointError(
        f"cannot rank by {policy.best_metric!r}: the index of step "
        f"{bad[0]['step']} is unreadable ({bad[0]['error']})")
  steps = [r["step"] for r in committed]
  metrics = {r["step"]: r.get("metrics", {}) for r in committed}
  doomed = policy.to_delete(steps, metrics)
  tmp = [r for r in rows if r["status"] == "uncommitted"]
  incomplete = [r for r in rows if r["status"] == "incomplete"]
  plan = []
  for s in doomed:
    r = by_name[names.step_dirname(s)]
    plan.append({"name": r["name"], "step": s, "kind": "step",
                 "bytes": r["bytes"], "reason": "retention policy"})
  skipped = []
  watched = _watch(storage, args, tmp)
  now = rename.store_now(storage) if storage.is_posix and tmp else None
  for r in tmp:
    age = r.get("age_s")
    if now is not None and r.get("time") is not None:
      age = max(0.0, now - r["time"])  # the file system's clock, not ours
    item = {"name": r["name"], "step": r["step"], "kind": "uncommitted",
            "bytes": r["bytes"], "age_s": age}
    if watched is not None and r["name"] not in watched[0]:
      skipped.append({**item, "reason": "its lease changed while gc watched "
                      f"it for {watched[1]:g} s; may be a save in progress"})
    elif (watched is None and args.tmp_min_age > 0
          and (age is None or age < args.tmp_min_age)):
      skipped.append({**item, "reason": f"last written {human_age(age)} ago; "
                      "may be a save in progress"})
    else:
      plan.append({**item, "reason": "abandoned save"})
  for r in incomplete:  # never without --incomplete: data may be recoverable
    item = {"name": r["name"], "step": r["step"], "kind": "incomplete",
            "bytes": r["bytes"], "problem": r["problem"]}
    if args.incomplete:
      plan.append({**item, "reason": f"incomplete: {r['problem']}"})
    else:
      skipped.append({**item, "reason": f"incomplete: {r['problem']}; "
                      "--incomplete deletes it"})
  deleted = []
  if args.yes:
    with Progress(args, "deleting", unit="dir") as bar:
      for i, item in enumerate(plan):
        if item["kind"] == "uncommitted":  # as it is now: never a new commit
          cleanup_lib.remove_abandoned(storage, item["name"])
        else:
          cleanup_lib.remove(storage, item["name"])
        deleted.append(item["name"])
        bar(i + 1, len(plan))
  kept = sorted(set(steps) - set(doomed))
  doc = {"directory": storage.url, "dry_run": not args.yes,
         "delete": plan, "deleted": deleted, "skipped": skipped,
         "kept": kept}
  verb = "deleted" if args.yes else "would delete"
  lines = []
  for item in plan:
    if item["kind"] == "step":
      what = f"step {item['step']}"
    elif item["kind"] == "incomplete":
      what = item["reason"]
    elif deletion.parse_name(item["name"]) is not None:
      what = "unfinished deletion"
    else:
      what = "abandoned save"
    lines.append(f"{verb} {item['name']} ({what}, "
                 f"{human_bytes(item['bytes'])})")
  for item in skipped:
    lines.append(f"kept {item['name']}: {item['reason']}" + (
        "" if item["kind"] == "incomplete" else
        f" (--tmp-min-age {args.tmp_min_age})"))
  lines.append(f"kept steps: {', '.join(map(str, kept)) or 'none'}")
  freed = sum(i["bytes"] or 0 for i in plan)
  if not plan:
    lines.append("nothing to delete")
  elif args.yes:
    lines.append(f"freed {human_bytes(freed)}")
  else:
    lines.append(f"dry run: nothing deleted ({human_bytes(freed)} would be "
                 "freed); pass --yes to delete")
  emit(args, doc, "\n".join(lines))
  return EXIT_OK
