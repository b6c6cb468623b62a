"""Where checkpoints live: URL to TensorStore kvstore, discovery, commit.

The storage driver comes from the URL the Checkpointer (or ``load``) is
given, never from a checkpoint's index, so a checkpoint copied between disks
and buckets restores unchanged. ``storage_options`` are merged into the
kvstore spec as they are (endpoint, region, ``s3_request_concurrency``,
``gcs_request_retries``, ...); the standard environment variables are read
here, so they work without code: ``AWS_ENDPOINT_URL`` (TensorStore's s3
driver ignores it), ``AWS_REGION`` and the AWS credential variables for
``s3://``, ``STORAGE_EMULATOR_HOST`` or ``TENSORSTORE_GCS_HTTP_URL`` for
``gs://``.

Commit protocol (the only place that knows it):
- POSIX file systems: a save writes into ``checkpoint_<step>.tmp-<token>``
  and commits with one ``rename`` to ``checkpoint_<step>``, which is atomic.
  Discovery trusts directories that hold an index (only a rename makes one
  appear under the final name). Deletion renames away first, so a
  half-deleted step is never visible.
- Object stores and ``memory://`` (no rename): a save writes into
  ``checkpoint_<step>/`` and commits by writing ``commit_success`` last, after
  every process has finished and the index is written. Discovery trusts only
  steps with the marker; deletion removes the marker first, then every key
  of the step through the store's own API.
- The marker is written on POSIX too (before the rename), so a step
  directory copied from a disk to a bucket is committed there as well.

Listing: TensorStore's ``KvStore.list`` takes a key range but no delimiter
and no page limit, so discovery on an object store lists every key under
``checkpoint_*`` (one listing per call, paged by the server: about 1,000 keys
a request). That is why ``format="ocdbt"`` (a few dozen keys per step) suits
buckets best. Every listed key is checked against the range asked for: a
server that ignores the range (an emulator without ``startOffset``) raises
instead of letting a deletion touch keys outside the step.
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
# Members of the kvstore spec that the URL decides; storage_options may not.
_FROM_URL = ("driver", "bucket", "path")
# TensorStore reads its GCS endpoint from this variable (no spec member).
_GCS_HTTP_URL = "TENSORSTORE_GCS_HTTP_URL"
# B+tree nodes of OCDBT databases (see ckpt/ocdbt.py), so a restore does not
# fetch the same nodes once per leaf. Array data is never cached.
OCDBT_CACHE_POOL = "cache_pool#ocdbt"
_OCDBT_CACHE_BYTES = 64 << 20

# memory:// data lives in a TensorStore context; one per process, so that a
# second Checkpointer (or ckpt.load) on the same memory:// URL sees it.
_MEMORY_CONTEXT: ts.Context | None = None


def step_dirname(step: int) -> str:
  return f"{STEP_PREFIX}{step}"


def parse_step(name: str) -> int | None:
  m = _STEP_RE.match(name)
  return int(m.group(1)) if m else None


def _env_s3_options() -> dict[str, Any]:
  """The endpoint and region the AWS environment variables ask for."""
  out: dict[str, Any] = {}
  endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3")
              or os.environ.get("AWS_ENDPOINT_URL"))
  if endpoint:
    out["endpoint"] = endpoint
  region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
  if region:
    out["aws_region"] = region
  return out


def _apply_gcs_emulator_env() -> None:
  """Points TensorStore at ``STORAGE_EMULATOR_HOST`` (the Google client
  libraries' variable) unless ``TENSORSTORE_GCS_HTTP_URL`` is set already.

  TensorStore reads its variable when a gcs kvstore opens, so setting it in
  this process's environment is how the endpoint gets there.
  """
  host = os.environ.get("STORAGE_EMULATOR_HOST")
  if host and not os.environ.get(_GCS_HTTP_URL):
    os.environ[_GCS_HTTP_URL] = host if "://" in host else f"http://{host}"


def kvstore_for_url(url: str, storage_options: dict | None = None
                    ) -> tuple[dict[str, Any], bool]:
  """(kvstore spec of the directory, whether it is a local file system)."""
  url = os.fspath(url)
  if storage_options is not None and not isinstance(storage_options, dict):
    raise CheckpointError(
        f"storage_options for {url!r} must be a dict merged into the "
        f"TensorStore kvstore spec, got {type(storage_options).__name__}")
  opts = dict(storage_options or {})
  taken = sorted(k for k in opts if k in _FROM_URL)
  if taken:
    raise CheckpointError(
        f"storage_options for {url!r} set {taken}, which come from the URL; "
        f"put them in the URL instead (storage_options has {sorted(opts)})")
  parsed = urllib.parse.urlparse(url)
  scheme = parsed.scheme if len(parsed.scheme) > 1 else ""  # C:\ on Windows
  if scheme in ("", "file"):
    path = parsed.path if scheme == "file" else url
    spec = {"driver": "file", "path": os.path.abspath(path).rstrip("/") + "/"}
    return _checked({**spec, **opts}, url, opts), True
  path = parsed.path.strip("/")
  path = path + "/" if path else ""
  if scheme in ("gs", "s3") and not parsed.netloc:
    raise CheckpointError(
        f"checkpoint URL {url!r} names no bucket; expected {scheme}://BUCKET/DIR")
  if scheme == "gs":
    _apply_gcs_emulator_env()
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
  return _checked({**spec, **opts}, url, opts), False


def _checked(spec: dict[str, Any], url: str, opts: dict) -> dict[str, Any]:
  """The spec, after TensorStore has parsed it (unknown options fail here)."""
  try:
    ts.KvStore.Spec(spec)
  except Exception as e:  # ValueError from TensorStore's JSON binding
    raise CheckpointError(
        f"the kvstore spec for {url!r} is invalid: {e}. storage_options was "
        f"{opts}; see TensorStore's documentation of the {spec['driver']!r} "
        "kvstore driver for the members it accepts") from e
  return spec


def join(spec: dict[str, Any], rel: str) -> dict[str, Any]:
  """The kvstore spec of ``rel`` (a relative directory) under ``spec``."""
  rel = rel.strip("/")
  return {**spec, "path": spec["path"] + (rel + "/" if rel else "")}


def _prefix_range(prefix: str) -> tuple[str, str]:
  """[lo, hi): every key that starts with ``prefix`` (non-empty)."""
  return prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)


def _split_resources(spec: dict[str, Any]) -> tuple[dict, dict]:
  """(spec, context resources): options given as JSON objects
  (``{"s3_request_concurrency": {"limit": 32}}``, ``aws_credentials``,
  ``gcs_request_retries``, the members of ``context``) are TensorStore
  context resources. They go into the Storage's context, where every
  kvstore opened with it shares them: inline in the spec, each open would
  make its own, and OCDBT can merge databases only over one shared base."""
  spec = dict(spec)
  resources = dict(spec.pop("context", None) or {})
  for k in [k for k, v in spec.items() if isinstance(v, dict)]:
    resources[k] = spec.pop(k)
  return spec, resources


class Storage:
  """One checkpoint root directory."""

  def __init__(self, url: str, storage_options: dict | None = None):
    self.url = os.fspath(url)
    spec, self.is_posix = kvstore_for_url(self.url, storage_options)
    self.spec, self._resources = _split_resources(spec)
    if self._resources and self.spec["driver"] == "memory":
      raise CheckpointError(
          f"{self.url!r}: memory:// shares one context per process and takes "
          f"no context resources; storage_options has {sorted(self._resources)}")
    if self.is_posix:
      self.root = epath.Path(self.spec["path"])
      self._kv = None
    else:
      self.root = None
      try:
        self._kv = ts.KvStore.open(self.spec, context=self.context()).result()
      except Exception as e:
        raise CheckpointError(
            f"cannot open {self.url!r} (kvstore {self.spec}): {e}") from e

  def context(self) -> ts.Context:
    global _MEMORY_CONTEXT
    if self.spec["driver"] == "memory":
      if _MEMORY_CONTEXT is None:
        _MEMORY_CONTEXT = ts.Context(
            {OCDBT_CACHE_POOL: {"total_bytes_limit": _OCDBT_CACHE_BYTES}})
      return _MEMORY_CONTEXT
    spec = {"file_io_concurrency": {"limit": 64},
            "cache_pool": {"total_bytes_limit": 0},
            OCDBT_CACHE_POOL: {"total_bytes_limit": _OCDBT_CACHE_BYTES},
            **self._resources}
    try:
      return ts.Context(spec)
    except Exception as e:  # ValueError from TensorStore's JSON binding
      raise CheckpointError(
          f"the context resources in storage_options for {self.url!r} are "
          f"invalid: {e}; they were {self._resources}") from e

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
    return sorted(self._scan()[0])

  def abandoned(self) -> list[str]:
    """Directories of saves that never committed (to clean up)."""
    if self.is_posix:
      if not self.root.exists():
        return []
      return sorted(p.name for p in self.root.iterdir() if _TMP_RE.match(p.name))
    committed, heads = self._scan()
    return sorted(step_dirname(s) for s in heads - committed)

  def _scan(self) -> tuple[set[int], set[int]]:
    """(committed steps, every step with a key) from ONE listing."""
    committed, heads = set(), set()
    for key in self._list(STEP_PREFIX):
      head, _, tail = key.partition("/")
      s = parse_step(head)
      if s is None or not tail:
        continue
      heads.add(s)
      if tail == COMMIT_MARKER:
        committed.add(s)
    return committed, heads

  def _list(self, prefix: str) -> list[str]:
    lo, hi = _prefix_range(prefix)
    keys = [k.decode() for k in
            self._kv.list(ts.KvStore.KeyRange(lo, hi)).result()]
    outside = [k for k in keys if not lo <= k < hi]
    if outside:
      raise CheckpointError(
          f"listing the keys of {self.url!r} that start with {prefix!r} "
          f"returned {len(outside)} keys outside that range (e.g. "
          f"{outside[:3]}): the server ignores the listing range (for GCS "
          "the startOffset/endOffset parameters). ckpt cannot discover or "
          "delete checkpoints safely through it; use a server that honours "
          "them")
    return keys

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
    """Makes ``step`` visible; the index must be written already."""
    final = step_dirname(step)
    # Not empty: some servers (gcp-storage-emulator) fail on empty objects.
    marker = f"{final} committed\n".encode()
    if self.is_posix:
      self.write_bytes(f"{work_dir}/{COMMIT_MARKER}", marker)
      os.rename(self.root / work_dir, self.root / final)
      _fsync_dir(self.root)
    else:
      self.write_bytes(f"{final}/{COMMIT_MARKER}", marker)

  def is_committed(self, step: int) -> bool:
    name = step_dirname(step)
    if self.is_posix:
      return (self.root / name / INDEX_NAME).exists()
    return self.read_bytes(f"{name}/{COMMIT_MARKER}") is not None

  def remove(self, name: str) -> None:
    """Deletes a step (or abandoned) directory; never leaves it half-visible."""
    if not (_STEP_RE.match(name) or _TMP_RE.match(name)):
      raise CheckpointError(
          f"refusing to delete {name!r} in {self.url!r}: ckpt deletes only "
          "checkpoint_<step> and checkpoint_<step>.tmp-<id> directories")
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
    # The marker first: from here on the step is not committed. Then each
    # key through the store's API (after checking that the listing stayed
    # inside the step), concurrently.
    self._kv.write(f"{name}/{COMMIT_MARKER}", None).result()
    pending = [self._kv.write(k, None) for k in self._list(f"{name}/")]
    for f in pending:
      f.result()

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
