"""Where checkpoints live: URL to TensorStore kvstore, discovery, commit.

The storage driver comes from the URL the Checkpointer (or ``load``) is
given, never from a checkpoint's index, so a checkpoint copied between disks
and buckets restores unchanged.

Commit protocol (the only place that knows it):
- POSIX file systems: a save writes into ``checkpoint_<step>.tmp-<token>``
  and commits with one ``rename`` to ``checkpoint_<step>``, which is atomic.
  Deletion renames away first, so a half-deleted step is never visible.
- Object stores and ``memory://`` (no rename): a save writes into
  ``checkpoint_<step>/`` and commits by writing ``commit_success`` last, after
  every process has finished. Discovery trusts only steps with the marker;
  deletion removes the marker first.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import urllib.parse
from typing import Any

from etils import epath
import tensorstore as ts

from ckpt.errors import CheckpointError

STEP_PREFIX = "checkpoint_"
INDEX_NAME = "index.msgpack"
COMMIT_MARKER = "commit_success"
_STEP_RE = re.compile(r"^checkpoint_(\d+)$")
_TMP_RE = re.compile(r"^checkpoint_(\d+)\.tmp-[0-9a-z\-]+$")

# memory:// data lives in a TensorStore context; one per process, so that a
# second Checkpointer (or ckpt.load) on the same memory:// URL sees it.
_MEMORY_CONTEXT: ts.Context | None = None


def step_dirname(step: int) -> str:
  return f"{STEP_PREFIX}{step}"


def parse_step(name: str) -> int | None:
  m = _STEP_RE.match(name)
  return int(m.group(1)) if m else None


def _env_s3_options() -> dict[str, Any]:
  out: dict[str, Any] = {}
  if os.environ.get("AWS_ENDPOINT_URL"):
    out["endpoint"] = os.environ["AWS_ENDPOINT_URL"]
  region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
  if region:
    out["aws_region"] = region
  return out


def kvstore_for_url(url: str, storage_options: dict | None = None
                    ) -> tuple[dict[str, Any], bool]:
  """(kvstore spec of the directory, whether it is a local file system)."""
  url = os.fspath(url)
  parsed = urllib.parse.urlparse(url)
  scheme = parsed.scheme if len(parsed.scheme) > 1 else ""  # C:\ on Windows
  opts = dict(storage_options or {})
  if scheme in ("", "file"):
    path = parsed.path if scheme == "file" else url
    spec = {"driver": "file", "path": os.path.abspath(path).rstrip("/") + "/"}
    return {**spec, **opts}, True
  path = parsed.path.strip("/")
  path = path + "/" if path else ""
  if scheme == "gs":
    spec = {"driver": "gcs", "bucket": parsed.netloc, "path": path}
  elif scheme == "s3":
    spec = {"driver": "s3", "bucket": parsed.netloc, "path": path,
            **_env_s3_options()}
  elif scheme == "memory":
    spec = {"driver": "memory", "path": (parsed.netloc + "/" + path).strip("/") + "/"}
  else:
    raise CheckpointError(
        f"unsupported checkpoint URL {url!r}: expected a path, file://, "
        "gs://, s3:// or memory://")
  return {**spec, **opts}, False


def join(spec: dict[str, Any], rel: str) -> dict[str, Any]:
  """The kvstore spec of ``rel`` (a relative directory) under ``spec``."""
  rel = rel.strip("/")
  return {**spec, "path": spec["path"] + (rel + "/" if rel else "")}


class Storage:
  """One checkpoint root directory."""

  def __init__(self, url: str, storage_options: dict | None = None):
    self.url = os.fspath(url)
    self.spec, self.is_posix = kvstore_for_url(self.url, storage_options)
    if self.is_posix:
      self.root = epath.Path(self.spec["path"])
      self._kv = None
    else:
      self.root = None
      self._kv = ts.KvStore.open(self.spec, context=self.context()).result()

  def context(self) -> ts.Context:
    global _MEMORY_CONTEXT
    if self.spec["driver"] == "memory":
      if _MEMORY_CONTEXT is None:
        _MEMORY_CONTEXT = ts.Context()
      return _MEMORY_CONTEXT
    return ts.Context({"file_io_concurrency": {"limit": 64},
                       "cache_pool": {"total_bytes_limit": 0}})

  # ---- small objects (index, marker) -------------------------------------

  def read_bytes(self, rel: str) -> bytes | None:
    if self.is_posix:
      p = self.root / rel
      return p.read_bytes() if p.exists() else None
    r = self._kv.read(rel).result()
    return None if r.state == "missing" else bytes(r.value)

  def write_bytes(self, rel: str, data: bytes) -> None:
    if self.is_posix:
      p = self.root / rel
      p.parent.mkdir(parents=True, exist_ok=True)
      tmp = p.parent / (p.name + ".partial")
      with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, p)
    else:
      self._kv.write(rel, data).result()

  # ---- discovery ---------------------------------------------------------

  def committed_steps(self) -> list[int]:
    if self.is_posix:
      if not self.root.exists():
        return []
      steps = [parse_step(p.name) for p in self.root.iterdir()]
      return sorted(s for s in steps if s is not None and
                    (self.root / step_dirname(s) / INDEX_NAME).exists())
    steps = set()
    for key in self._list(STEP_PREFIX):
      head, _, tail = key.partition("/")
      s = parse_step(head)
      if s is not None and tail == COMMIT_MARKER:
        steps.add(s)
    return sorted(steps)

  def abandoned(self) -> list[str]:
    """Directories of saves that never committed (to clean up)."""
    if self.is_posix:
      if not self.root.exists():
        return []
      return sorted(p.name for p in self.root.iterdir() if _TMP_RE.match(p.name))
    committed = set(self.committed_steps())
    heads = {k.partition("/")[0] for k in self._list(STEP_PREFIX)}
    return sorted(h for h in heads
                  if parse_step(h) is not None and parse_step(h) not in committed)

  def _list(self, prefix: str) -> list[str]:
    rng = ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))
    return [k.decode() for k in self._kv.list(rng).result()]

  # ---- the commit protocol ------------------------------------------------

  def work_dir(self, step: int, token: str) -> str:
    """The relative directory a save of ``step`` writes into."""
    if self.is_posix:
      return f"{step_dirname(step)}.tmp-{token}"
    return step_dirname(step)

  def prepare(self, step: int, work_dir: str) -> None:
    """Process 0, before anyone writes: an empty work directory."""
    if self.is_posix:
      self.root.mkdir(parents=True, exist_ok=True)
      # An uncommitted checkpoint_<step>/ (no index: a partial copy, say)
      # would make the commit rename fail on every try; drop it, as the
      # object-store branch below drops its leftovers.
      final = self.root / step_dirname(step)
      if final.is_dir() and not self.is_committed(step):
        self.remove(step_dirname(step))
    else:
      self.remove(work_dir)  # leftovers of an interrupted save of this step

  def commit(self, step: int, work_dir: str) -> None:
    final = step_dirname(step)
    if self.is_posix:
      os.rename(self.root / work_dir, self.root / final)
      _fsync_dir(self.root)
    else:
      self.write_bytes(f"{final}/{COMMIT_MARKER}", b"")

  def is_committed(self, step: int) -> bool:
    name = step_dirname(step)
    if self.is_posix:
      return (self.root / name / INDEX_NAME).exists()
    return self.read_bytes(f"{name}/{COMMIT_MARKER}") is not None

  def remove(self, name: str) -> None:
    """Deletes a step (or abandoned) directory; never leaves it half-visible."""
    if self.is_posix:
      path = self.root / name
      if not path.exists():
        return
      if _STEP_RE.match(name):
        doomed = self.root / f"{name}.tmp-del-{secrets.token_hex(4)}"
        os.rename(path, doomed)
        path = doomed
      shutil.rmtree(path, ignore_errors=True)
      return
    self._kv.delete_range(ts.KvStore.KeyRange(f"{name}/{COMMIT_MARKER}",
                                              f"{name}/{COMMIT_MARKER}\0")
                          ).result()
    self._kv.delete_range(ts.KvStore.KeyRange(f"{name}/", f"{name}0")).result()

  def step_spec(self, rel_dir: str) -> dict[str, Any]:
    return join(self.spec, rel_dir)

  def index_key(self, rel_dir: str) -> str:
    return f"{rel_dir}/{INDEX_NAME}" if rel_dir else INDEX_NAME


def _fsync_dir(path: epath.Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
