"""The step directories of the local tier (ckpt/tiers/local_tier.py) on one
process: ``LocalSteps`` lists the committed ``step_<N>`` directories, reads
and validates their manifests, verifies their files' sizes and crc32c,
removes steps of another run and leftovers of crashed saves, applies
retention, and hides / restores / drops a step for
``MultiTierCheckpointer.delete``; ``remove_step`` renames a step away before it
deletes it.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import crc32c
from absl import logging

from ckpt.multihost import process as multihost
from ckpt.tiers.local_exchange import TierRounds
from ckpt.tiers.local_manifest import (DATA_FILES, MAX_MANIFEST_BYTES,
                                       check_manifest)
from ckpt.errors import CorruptCheckpointError
from ckpt.commit import attempt

_CRC_CHUNK = 64 << 20   # bytes read at a time to verify a shard
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^step_\d+\.(tmp|del)-[0-9a-f]+$")


class LocalSteps:
  """This process's step directories of the local tier (listing, manifests,
  retention, delete)."""

  def __init__(self, root: str, keep: int, owner: str, rounds: TierRounds):
    self.pid = multihost.process_index()
    self.dir = os.path.join(root, f"process_{self.pid}")
    os.makedirs(self.dir, exist_ok=True)
    self.keep = keep
    # The persistent tier this local tier belongs to: steps of another are
    # never restored and are removed at the next save.
    self.owner = owner
    self._rounds = rounds
    # The step saved last as the job's newest (retention keeps it, and
    # removes the steps above it: MultiTierCheckpointer.save refused them).
    self._newest_saved: int | None = None
    # A resume returned this step: the steps above it are set aside
    # (``set_aside_above``) until the next local save removes them.
    self._aside_above: int | None = None

  def saving_newest(self, step: int) -> None:
    """``step`` is the job's newest step (see ``retain``)."""
    self._newest_saved = step

  def committed_steps(self) -> list[int]:
    """The committed steps of this process, but those a resume set aside
    (``set_aside_above``)."""
    steps = self._on_disk()
    if self._aside_above is None:
      return steps
    return [s for s in steps if s <= self._aside_above]

  def _on_disk(self) -> list[int]:
    try:
      names = os.listdir(self.dir)
    except FileNotFoundError:
      return []
    return sorted(int(m.group(1)) for m in map(_STEP_RE.match, names) if m)

  def set_aside_above(self, step: int) -> list[int]:
    """A resume returned ``step`` (every process, the same): the committed
    steps above it (returned) no longer count for this job (its queries,
    restores and save refusals: one timeline, the restored one), and the
    next local save removes them (``drop_set_aside``). Local, no I/O but
    a listing."""
    above = [s for s in self._on_disk() if s > step]
    self._aside_above = step if above else None
    return above

  def drop_set_aside(self) -> None:
    """At a local save, before its start round (caller's thread): the
    steps a resume set aside are renamed away (atomic; the writer's
    ``remove_leftovers`` deletes them), so no restart resumes them once
    a step of the restored timeline is committed. Raises OSError."""
    floor = self._aside_above
    if floor is None:
      return
    for s in self._on_disk():
      if s > floor:
        logging.info("ckpt: local tier removes step %d, set aside when the "
                     "job resumed step %d", s, floor)
        self.hide_step(s)
    self._aside_above = None

  def manifest(self, step: int) -> dict:
    """The validated manifest of ``step`` (this process's); raises
    CorruptCheckpointError naming the file, what was expected and found."""
    path = os.path.join(self.dir, f"step_{step}", "manifest.json")
    try:
      with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
      raise CorruptCheckpointError(
          f"local step {step}: cannot read {path}: {e}") from e
    if len(data) > MAX_MANIFEST_BYTES:
      raise CorruptCheckpointError(
          f"local step {step}: {path} has more than MAX_MANIFEST_BYTES = "
          f"{MAX_MANIFEST_BYTES} bytes: not a manifest of the local tier")
    try:
      m = json.loads(data)
    except ValueError as e:
      raise CorruptCheckpointError(
          f"local step {step}: {path} is not JSON ({len(data)} bytes): "
          f"{str(e)[:200]}") from e
    check_manifest(m, step, self.pid, path)
    return m

  def foreign(self, m: dict) -> str:
    """Why a valid manifest belongs to another run ('' if it is ours)."""
    lay = self._rounds.layout
    if m["owner"] != self.owner:
      return (f"it was saved for the persistent tier {m['owner']!r}, this "
              f"job's is {self.owner!r} (a local directory left by another "
              "run)")
    if m["process_count"] != lay.n or m["local_devices"] != lay.L:
      return (f"it was saved by {m['process_count']} processes x "
              f"{m['local_devices']} devices, this job has {lay.n} x {lay.L}")
    return ""

  def remove_unusable(self) -> None:
    """At a save (writer thread, local only): committed steps of another
    run (persistent root, topology) or with a bad manifest go: they are
    never restored, and retention must not keep them over this run's."""
    for s in self.committed_steps():
      try:
        why = self.foreign(self.manifest(s))
      except CorruptCheckpointError as e:
        why = str(e)
      if why:
        path = os.path.join(self.dir, f"step_{s}")
        logging.info("ckpt: local tier removes %s: %s", path, why)
        try:
          remove_step(path, self.dir, s)
        except OSError as e:
          logging.warning("ckpt: local tier could not remove %s: %s", path, e)

  def verify(self, step: int, m: dict, part: str | None) -> str:
    """'' if the data file of ``part`` (None: host.msgpack) of ``step``
    has the size and every shard the crc32c its manifest records; else why
    (naming the file, what was expected and what was found)."""
    base = os.path.join(self.dir, f"step_{step}")
    fname = "host.msgpack" if part is None else DATA_FILES[part]
    path = os.path.join(base, fname)
    want = m["files"][fname]
    try:
      size = os.path.getsize(path)
    except OSError as e:
      if want == 0 and isinstance(e, FileNotFoundError):
        return ""
      return f"local step {step}: cannot read {path}: {e}"
    if size != want:
      return (f"local step {step}: {path} is {size} bytes, its manifest says "
              f"{want} (truncated or overwritten)")
    if part is None:
      spans = [(0, size, m["crc32c"]["host.msgpack"], "host values")]
    else:
      spans = [(sh[1], sh[2], sh[4], f"leaf {name} shard {k}")
               for name, e in m[part].items()
               for k, sh in enumerate(e["shards"])]
    try:
      with open(path, "rb") as f:
        for off, nb, crc, what in sorted(spans):
          f.seek(off)
          got, left = 0, nb
          while left:
            chunk = f.read(min(left, _CRC_CHUNK))
            if not chunk:
              return (f"local step {step}: {path} ended at byte "
                      f"{off + nb - left}, {what} ends at {off + nb}")
            got = crc32c.crc32c(chunk, got)
            left -= len(chunk)
          if got != crc:
            return (f"local step {step}: {path}: {what} (bytes {off}.."
                    f"{off + nb}) has crc32c {got:#010x}, its manifest says "
                    f"{crc:#010x} (the file is corrupt)")
    except OSError as e:
      return f"local step {step}: cannot read {path}: {e}"
    return ""

  def retain(self) -> None:
    """Keeps the ``keep`` newest steps up to the step saved last, never
    that step, whatever its number.

    The step saved last is set by MultiTierCheckpointer.save
    (``saving_newest``), which refused the save if the job could rebuild
    any local step above it: steps above it here are parts of steps no
    restore can use (a host and its partner lost), and go too. Without it
    (the class alone): the highest steps are kept."""
    steps = self.committed_steps()
    head = self._newest_saved
    above = []
    if head in steps:
      above = [s for s in steps if s > head]
      steps = [s for s in steps if s <= head]
    for s in above + steps[:-self.keep]:
      try:
        remove_step(os.path.join(self.dir, f"step_{s}"), self.dir, s)
      except OSError as e:
        logging.warning("ckpt: local tier could not delete step %d: %s", s, e)

  # -- delete (MultiTierCheckpointer.delete) --

  def hide_step(self, step: int) -> str | None:
    """This process's ``step_<step>`` renamed away (atomic): the path it
    now has, or None if this process holds no such step. Raises OSError
    if the rename fails (the step is then unchanged). ``unhide_step``
    puts it back, ``drop_hidden`` removes it; a hidden step left by a
    crash is removed at the next save (as any ``.del-`` directory)."""
    path = os.path.join(self.dir, f"step_{step}")
    if not os.path.isdir(path):
      return None
    gone = os.path.join(self.dir,
                        f"step_{step}.del-{multihost.unique_token()}")
    os.rename(path, gone)
    try:
      attempt.fsync_dir(self.dir)
    except OSError as e:  # renamed: the step is hidden all the same
      logging.warning("ckpt: local tier could not fsync %s: %s", self.dir, e)
    return gone

  def unhide_step(self, step: int, hidden: str) -> None:
    os.rename(hidden, os.path.join(self.dir, f"step_{step}"))

  @staticmethod
  def drop_hidden(hidden: str) -> None:
    shutil.rmtree(hidden, ignore_errors=True)

  def remove_leftovers(self, keep: str) -> None:
    for name in os.listdir(self.dir):
      if _TMP_RE.match(name) and name != keep:
        logging.info("ckpt: local tier removes leftover %s",
                     os.path.join(self.dir, name))
        shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)


def remove_step(path: str, parent: str, step: int) -> None:
  """Renames a committed step away first, so it is never half-deleted."""
  gone = os.path.join(parent, f"step_{step}.del-{multihost.unique_token()}")
  os.rename(path, gone)
  shutil.rmtree(gone, ignore_errors=True)
