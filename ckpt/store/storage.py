"""Where checkpoints live: a root's TensorStore context, small objects, listing.

The names of keys are ckpt/store/names.py's, a URL's kvstore spec ckpt/store/urls.py's
(both still importable from here).

The storage driver comes from the URL the Checkpointer (or ``load``) is
given, never from a checkpoint's index, so a checkpoint copied between disks
and buckets restores unchanged. ``storage_options`` are merged into the
kvstore spec as they are (endpoint, region, ``s3_request_concurrency``,
``gcs_request_retries``, ...); the standard environment variables are read
(ckpt/store/urls.py), so they work without code: ``AWS_ENDPOINT_URL``
(TensorStore's s3 driver ignores it), ``AWS_REGION`` and the AWS credential
variables for ``s3://``, ``STORAGE_EMULATOR_HOST`` or
``TENSORSTORE_GCS_HTTP_URL`` for ``gs://``.

The commit protocol (attempts, markers, what cleanup may delete) lives in
ckpt/commit/protocol.py; this module gives it small objects, listings and deletions.

Listing: TensorStore's ``KvStore.list`` takes a key range but no delimiter
and no page limit, so listing ``checkpoint_*`` on an object store returns
every key of every step (one per chunk with zarr). Discovery therefore lists
the flat prefix of commit records instead (``commits/``, one key per
committed step; see ckpt/commit/protocol.py), and only a root written before those
records existed is listed in full. Deleting a step still lists its own keys
(it deletes each). Every listed key is checked against the range asked for:
a server that ignores the range (an emulator without ``startOffset``)
raises instead of letting a deletion touch keys outside the step.

A dead store fails in bounded time, at two levels:

- Each request: TensorStore retries a request 32 times with backoff up to
  32 s by default (about 15 minutes before an error), so every context made
  here retries ``STORE_RETRIES``: a store that refuses connections fails a
  request after about 80 s. ``s3_request_retries`` / ``gcs_request_retries``
  in storage_options override it member by member. Retries do not bound a
  store that accepts connections and never answers: curl then waits
  forever, unless ``TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS`` is set.
- Each whole operation (ckpt/store/deadline.py), since one is many requests in
  sequence: a save (from its first request to its commit, including the
  removal of a failed attempt) fails once it went the Checkpointer's
  ``save_timeout_s`` (default 120 s; also each retention pass and
  ``delete``) without progress, a query (``latest_step``, ``all_steps``,
  ``metrics``, ``metadata``, the choice of step of ``restore`` and
  ``host_state``, and opening the store) or a restore's reads of data
  ``query_timeout_s`` (default 60 s), whether the store refuses or never
  answers; a slow store that keeps completing requests never fails them.
  Every wait of this module (``Storage.result``) and every awaited
  TensorStore future (``tsfuture.wait``) checks the bound; requests in
  flight when it gives up are abandoned, not cancelled. Before these
  bounds, a store that died right after an async ``save()`` returned took
  162 s to fail the save (refused) or never failed it (no answer: none
  after 400 s), and a new Checkpointer's ``latest_step()`` took 81 s
  (refused) or never answered.

Errors of the store come out of ``Storage`` as ``CheckpointError`` naming
the URL, the operation and the step; a deadline's as ``StoreTimeoutError``
(a CheckpointError) that also names the bound and the option that sets it:
"writing step 5 to 's3://b/run' stalled: nothing it waited for from the
store completed for 120.0 s ... The bound is the Checkpointer argument
save_timeout_s=120 ...".
"""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from typing import Any

from etils import epath
import tensorstore as ts

from ckpt.store import deadline as deadline_lib
from ckpt.store import traffic
from ckpt.store.names import INDEX_NAME, describe, describe_listing
from ckpt.store.urls import join, kvstore_for_url
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.errors import StoreTimeoutError

# B+tree nodes of OCDBT databases (see ckpt/store/ocdbt.py), so a restore does not
# fetch the same nodes once per leaf. Array data is never cached.
OCDBT_CACHE_POOL = "cache_pool#ocdbt"
_OCDBT_CACHE_BYTES = 64 << 20
# Retries of one object-store request: 1, 2, 4, 8, 16, 16, 16, 16 s apart
# (plus up to 1 s of jitter each), so a store that does not answer fails a
# request after about 80 s instead of TensorStore's 15 minutes (32 retries,
# backoff up to 32 s). A transient outage of a minute is still ridden out.
STORE_RETRIES = {"max_retries": 8, "initial_delay": "1s", "max_delay": "16s"}
_RETRY_RESOURCES = ("s3_request_retries", "gcs_request_retries")
# The request queue of a driver: a context that names none shares
# TensorStore's default with every context of the process that names none
# (one queue of 32 requests), so a lease renewal (ckpt/commit/renewal.py)
# waited behind the save's uploads: gaps of 75 s between renewals
# (lease_s=30) while a save crawled at 1 MiB/s. ``context(own_queue=True)``
# gets a queue of its own, whatever storage_options say.
_QUEUES = {"s3": "s3_request_concurrency", "gcs": "gcs_request_concurrency"}
OWN_QUEUE_LIMIT = 4
# Local files are read through mmap, not pread: a pread fills a fresh
# buffer of the whole chunk file (its pages faulted in and zeroed, then
# copied from the page cache) that is copied again into the restore's
# buffer; mapped, the page cache is copied once, straight into that buffer,
# and a box that needs part of a chunk touches only that part's pages.
# Measured on 1 GiB of float32 in 16 MiB chunks (2 cores): 64 chunk reads
# into fresh buffers 1.9 s -> 0.38 s. Safe because no file of a checkpoint
# is ever changed in place (TensorStore writes a new file and renames it;
# deletion unlinks), so no mapped file shrinks under a read. On a network
# file system whose files another host may delete or truncate mid-read (a
# mapped page that vanishes is SIGBUS, not an error),
# storage_options={"file_io_mode": {"mode": "default"}} restores pread.
FILE_IO_MODE = {"mode": "memmap"}
# The largest small object (index, commit marker, lease) ckpt reads; the
# index has its own, equal limit (ckpt.format.index.MAX_INDEX_BYTES).
MAX_OBJECT_BYTES = 32 << 20
# How a ranged read past the end of an object fails: TensorStore's
# OUT_OF_RANGE (S3's 416 too), or, from some emulators, a Content-Range
# TensorStore rejects.
_SMALLER = ("OUT_OF_RANGE", "not satisfied", "not valid for value of size",
            "Content-Range")

# memory:// data lives in a TensorStore context; one per process, so that a
# second Checkpointer (or ckpt.load) on the same memory:// URL sees it.
_MEMORY_CONTEXT: ts.Context | None = None


def write_file(path: str, data: bytes) -> None:
  """Writes ``path`` durably (a fresh temporary file, fsynced, renamed
  over it) inside an EXISTING directory: it never creates one."""
  tmp = f"{path}.partial-{secrets.token_hex(4)}"
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise


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
    # ckpt/commit/protocol.py's cache: this root's commit records were seen complete
    # (they never stop being so once they are).
    self.records_complete = False
    if self.is_posix:
      self.root = epath.Path(self.spec["path"])
      self._kv = None
    else:
      self.root = None
      traffic.watch(self.spec)  # its bytes in flight are progress
      try:
        self._kv = self.result(ts.KvStore.open(self.spec,
                                               context=self.context()))
      except StoreTimeoutError as e:
        raise e.deadline.error(f"opening {self.url!r}") from None
      except Exception as e:
        raise CheckpointError(
            f"cannot open {self.url!r} (kvstore {self.spec}): {e}") from e

  def context(self, own_queue: bool = False) -> ts.Context:
    """A new TensorStore context for this root (memory://: the process's
    one). ``own_queue``: with a request queue of its own (``_QUEUES``),
    never shared with another context."""
    global _MEMORY_CONTEXT
    if self.spec["driver"] == "memory":
      if _MEMORY_CONTEXT is None:
        _MEMORY_CONTEXT = ts.Context(
            {OCDBT_CACHE_POOL: {"total_bytes_limit": _OCDBT_CACHE_BYTES}})
      return _MEMORY_CONTEXT
    spec = {"file_io_concurrency": {"limit": 64},
            **({"file_io_mode": dict(FILE_IO_MODE)}
               if self.spec["driver"] == "file" else {}),
            "cache_pool": {"total_bytes_limit": 0},
            OCDBT_CACHE_POOL: {"total_bytes_limit": _OCDBT_CACHE_BYTES},
            **{k: dict(STORE_RETRIES) for k in _RETRY_RESOURCES},
            **self._resources}
    for k in _RETRY_RESOURCES:  # the user's members win, ours fill the rest
      if isinstance(self._resources.get(k), dict):
        spec[k] = {**STORE_RETRIES, **self._resources[k]}
    if own_queue and self.spec["driver"] in _QUEUES:
      spec[_QUEUES[self.spec["driver"]]] = {"limit": OWN_QUEUE_LIMIT}
    try:
      return ts.Context(spec)
    except Exception as e:  # ValueError from TensorStore's JSON binding
      raise CheckpointError(
          f"the context resources in storage_options for {self.url!r} are "
          f"invalid: {e}; they were {self._resources}") from e

  @staticmethod
  def result(future):
    """``future.result()`` of a call into the store, within the deadline of
    the operation in progress (ckpt/store/deadline.py). Every wait of this module
    goes through it; callers outside call it inside ``store_errors``."""
    return deadline_lib.result(future)

  @contextlib.contextmanager
  def store_errors(self, doing: str):
    """Re-raises an error of the store (TensorStore's ValueError, OSError) as
    CheckpointError naming ``doing`` ("listing the steps of") and the URL;
    ckpt's own errors pass unchanged, but for a wait that ran past the
    deadline, which is told what it waited for. For every call into
    ``self.kv``."""
    try:
      yield
    except StoreTimeoutError as e:
      if e.deadline is None or e.doing is not None:
        raise
      raise e.deadline.error(f"{doing} {self.url!r}") from None
    except CheckpointError:
      raise
    except Exception as e:
      hint = ""
      if "retry attempts failed" in str(e):
        gcs = self.spec["driver"] == "gcs"
        res = f"{'gcs' if gcs else 's3'}_request_retries"
        hint = (f". The store did not answer; storage_options={{{res!r}: "
                "{...}} sets how long ckpt retries each request (default "
                f"{STORE_RETRIES})")
      raise CheckpointError(f"{doing} {self.url!r} failed: {e}{hint}") from e

  # ---- small objects (index, marker) -------------------------------------

  def read_bytes(self, rel: str, limit: int | None = None) -> bytes | None:
    """A small object's bytes (None if missing). One larger than ``limit``
    (default MAX_OBJECT_BYTES) is refused before it is read: a stat on POSIX
    (where only a regular file is read), a one-byte ranged read at offset
    ``limit`` on an object store; the length is checked again after the
    read, so an object replaced in between costs at most one read."""
    limit = MAX_OBJECT_BYTES if limit is None else limit
    with self.store_errors(f"reading {describe(rel)} from"):
      if self.is_posix:
        return self._read_file(rel, limit)
      self._check_object_size(rel, limit)
      r = self.result(self._kv.read(rel))
      data = None if r.state == "missing" else bytes(r.value)
    if data is not None and len(data) > limit:
      self._too_large(rel, len(data), limit)
    return data

  def read_head(self, rel: str, size: int) -> bytes | None:
    """At most the first ``size`` bytes of ``rel`` in ONE request (None if
    missing), for objects written padded to at least ``size`` bytes (commit
    records): bounded memory without the size probe of ``read_bytes``. An
    object shorter than ``size`` (not padded: written by hand) is read with
    ``read_bytes`` instead. The caller checks whether it got it whole."""
    if self.is_posix:
      return self.read_bytes(rel)
    with self.store_errors(f"reading {describe(rel)} from"):
      try:
        r = self.result(self._kv.read(rel, byte_range=slice(0, size)))
      except Exception as e:  # pylint: disable=broad-except
        if not any(s in str(e) for s in ("OUT_OF_RANGE", "not satisfied",
                                         "not valid for value of size",
                                         "Content-Range")):
          raise
        r = None
    if r is None:
      return self.read_bytes(rel)
    return None if r.state == "missing" else bytes(r.value)

  def exists(self, rel: str) -> bool:
    """Whether the object (file) ``rel`` exists: one request reading at
    most one byte on an object store."""
    if self.is_posix:
      return os.path.isfile(os.path.join(os.fspath(self.root), rel))
    with self.store_errors(f"reading {describe(rel)} from"):
      try:
        r = self.result(self._kv.read(rel, byte_range=slice(0, 1)))
      except Exception as e:  # pylint: disable=broad-except
        if any(s in str(e) for s in ("OUT_OF_RANGE", "not satisfied",
                                     "not valid for value of size",
                                     "Content-Range")):
          return True  # an empty object
        raise
    return r.state != "missing"

  def read_generation(self, rel: str, limit: int | None = None
                      ) -> tuple[bytes | None, bytes]:
    """(a small object's bytes or None if missing, the storage generation
    that read saw), for a later ``delete_key(rel, generation=...)``
    (object stores)."""
    limit = MAX_OBJECT_BYTES if limit is None else limit
    with self.store_errors(f"reading {describe(rel)} from"):
      self._check_object_size(rel, limit)
      r = self.result(self._kv.read(rel))
    if r.state == "missing":
      return None, bytes(r.stamp.generation)
    data = bytes(r.value)
    if len(data) > limit:
      self._too_large(rel, len(data), limit)
    return data, bytes(r.stamp.generation)

  def generation(self, rel: str) -> bytes | None:
    """The storage generation of the object ``rel`` (S3 ETag, GCS
    generation; object stores), None if it is missing: one request
    without a body."""
    with self.store_errors(f"reading {describe(rel)} from"):
      r = self.result(self._kv.read(rel, byte_range=slice(0, 0)))
    return None if r.state == "missing" else bytes(r.stamp.generation)

  def delete_key(self, rel: str, generation: bytes | None = None) -> bool:
    """Deletes one key (object stores; a missing key is not an error).

    With ``generation`` (from ``read_generation`` or ``write_bytes``): only
    if the key still holds what was read or written then; returns whether
    it did (tried on memory, file and moto: a stale generation deletes
    nothing). TensorStore's memory and file drivers check it in the same
    operation, its gcs driver sends the DELETE with ifGenerationMatch
    (GCS checks it; gcp-storage-emulator ignores it), its s3 driver sends
    a HEAD with If-Match, then the DELETE (S3 has no conditional DELETE):
    a replacement between those two requests is not seen
    (ckpt/commit/deletion.py relies on this only where that is harmless)."""
    with self.store_errors(f"deleting {describe(rel)} from"):
      if generation is None:
        self.result(self._kv.write(rel, None))
        return True
      r = self.result(self._kv.write(rel, None, if_equal=generation))
    return bool(r.generation)  # empty: the condition failed

  def _read_file(self, rel: str, limit: int) -> bytes | None:
    path = os.path.join(os.fspath(self.root), rel)
    try:
      st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
      return None
    if not stat.S_ISREG(st.st_mode):
      raise CorruptCheckpointError(
          f"{self.url.rstrip('/')}/{rel} ({describe(rel)}): expected a "
          f"regular file, found file mode {stat.filemode(st.st_mode)}; "
          "refusing to read it")
    if st.st_size > limit:
      self._too_large(rel, st.st_size, limit)
    try:
      with open(path, "rb") as f:  # read(n) allocates n bytes up front
        data = f.read(min(st.st_size, limit) + 1)
    except (FileNotFoundError, NotADirectoryError):
      return None  # deleted between the stat and the open (retention)
    if len(data) > limit:
      self._too_large(rel, len(data), limit)
    return data

  def _check_object_size(self, rel: str, limit: int) -> None:
    """Raises if the object holds a byte at offset ``limit``: TensorStore
    answers OUT_OF_RANGE for a range past the end of a smaller object (some
    emulators send a Content-Range TensorStore rejects instead)."""
    try:
      r = self.result(self._kv.read(rel, byte_range=slice(limit, limit + 1)))
    except Exception as e:  # pylint: disable=broad-except
      text = str(e)
      if any(s in text for s in ("OUT_OF_RANGE", "not valid for value of size",
                                 "Content-Range")):
        return  # smaller than the limit
      raise
    if r.state == "value" and len(r.value):
      self._too_large(rel, limit + 1, limit, at_least=True)

  def _too_large(self, rel: str, size: int, limit: int, at_least=False):
    raise CorruptCheckpointError(
        f"{self.url.rstrip('/')}/{rel} ({describe(rel)}): "
        f"{'more than ' if at_least else ''}{size - at_least} bytes, over "
        f"the {limit}-byte limit; refusing to read it (not a ckpt index, "
        "or a hostile one)")

  def write_bytes(self, rel: str, data: bytes) -> bytes | None:
    """Writes a small object; returns its storage generation (object
    stores; None on POSIX)."""
    with self.store_errors(f"writing {describe(rel)} to"):
      if self.is_posix:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        write_file(os.fspath(p), data)
        return None
      return bytes(self.result(self._kv.write(rel, data)).generation)

  # ---- listing and deleting keys (object stores) ---------------------------

  @property
  def kv(self) -> ts.KvStore:
    """The open kvstore of an object store (None on POSIX)."""
    return self._kv

  def list_keys(self, prefix: str) -> list[str]:
    """Every key under ``prefix`` (object stores), checked to be inside it.

    TensorStore's ``KvStore.list`` takes a key range but no delimiter and
    no page limit: the servers page it (about 1,000 keys a request)."""
    lo, hi = _prefix_range(prefix)
    with self.store_errors(describe_listing(prefix)):
      keys = [k.decode() for k in
              self.result(self._kv.list(ts.KvStore.KeyRange(lo, hi)))]
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

  def list_all(self) -> list[str]:
    """Every key under the directory (object stores)."""
    with self.store_errors("listing every key of"):
      return [k.decode() for k in self.result(self._kv.list())]

  def sizes_at_least(self, keys: list[str], size: int) -> list[bool]:
    """Whether each object holds at least ``size`` (> 0) bytes (object
    stores): one read of its byte ``size - 1`` each, all at once (a
    listing through TensorStore carries no sizes)."""
    with self.store_errors("reading object sizes from"):
      pending = [self._kv.read(k, byte_range=slice(size - 1, size))
                 for k in keys]
      out = []
      for f in pending:
        try:
          r = self.result(f)
        except Exception as e:  # pylint: disable=broad-except
          if not any(s in str(e) for s in _SMALLER):
            raise
          r = None
        out.append(r is not None and r.state == "value" and len(r.value) > 0)
    return out

  def delete_prefix(self, prefix: str, what: str) -> None:
    """Deletes every key under ``prefix`` (object stores), concurrently,
    after checking that the listing stayed inside it."""
    self.delete_keys(self.list_keys(prefix), what)

  def delete_keys(self, keys: list[str], what: str) -> None:
    """Deletes ``keys`` (object stores), concurrently."""
    with self.store_errors(f"deleting {what} from"):
      pending = [self._kv.write(k, None) for k in keys]
      for f in pending:
        self.result(f)

  def step_spec(self, rel_dir: str) -> dict[str, Any]:
    return join(self.spec, rel_dir)

  def index_key(self, rel_dir: str) -> str:
    return f"{rel_dir}/{INDEX_NAME}" if rel_dir else INDEX_NAME
