"""Object stores and ``memory://``: an attempt writes into
``checkpoint_<step>/attempt-<token>/`` and its commit is the create-only
marker ``checkpoint_<step>/commit_success`` then the flat record
``commits/<step>``; a step is committed when its record exists (a root
written before records: its marker). ckpt/commit/protocol.py describes the
protocol and the records."""

from __future__ import annotations

import json
import math
import time
from typing import Callable

from absl import logging
import msgpack
import tensorstore as ts

from ckpt.commit import deletion
from ckpt.commit import lease as lease_lib
from ckpt.commit import records
from ckpt.commit.attempt import (ATTEMPT_FILE, ATTEMPT_PREFIX, NO_VALUE,
                                 Cleaner, committed_elsewhere, removed_error)
from ckpt.store import names
from ckpt.store import storage as storage_lib
from ckpt.store import traffic
from ckpt.errors import CheckpointError


class SightingsClock:
  """How one cleanup pass dates leases on an object store: by the
  cleaner's ``Sightings`` of their generations (ckpt/commit/lease.py)."""

  def __init__(self, storage: storage_lib.Storage,
               seen: lease_lib.Sightings | None):
    self.storage = storage
    self.seen = lease_lib.Sightings() if seen is None else seen
    self.dated: list[str] = []  # the attempts dated by ``seen``

  def age_s(self, rel: str, generation: bytes | None) -> float | None:
    """Seconds the attempt at ``rel`` has been seen unchanged (None:
    unknown); ``generation``: its lease's (None: no lease)."""
    if generation is None:
      # No attempt.json (yet, or any more): its pending record's.
      s, _, tail = rel.partition("/")
      m = records.ATTEMPT_DIR_RE.match(tail)
      step = names.parse_step(s)
      if not m or step is None:
        return None
      data, generation = self.storage.read_generation(
          records.pending_key(step, m.group(1)))
      if data is None:
        return None
    self.dated.append(rel)
    return self.seen.unchanged_for(rel, generation)

  def forget_unseen(self) -> None:
    """What is no longer there is forgotten."""
    self.seen.keep_only(self.dated)


class ObjectLease:
  """An attempt's lease on an object store (ckpt/commit/renewal.py renews
  it): each renewal a write conditional on the generation of the last, so
  a removed or replaced lease is seen."""

  def __init__(self, storage: storage_lib.Storage, key: str, token: str,
               request_s: float):
    self.storage, self.key, self.token = storage, key, token
    self.request_s = request_s  # one request's bound
    self.generation: bytes | None = None
    self._kv = None

  def _open(self):
    if self._kv is None:
      traffic.aside(0)  # (opening may ask for the bucket's region)
      self._kv = ts.KvStore.open(
          self.storage.spec, context=self.storage.context(own_queue=True)
      ).result(timeout=self.request_s)
    return self._kv

  def renew(self, data: bytes, count: int) -> str | None:
    """Writes ``data`` (renewal ``count``); why the lease is lost, or None.
    Each request is announced as no progress of the save (traffic.aside),
    and goes through a request queue of its own (Storage.context)."""
    kv = self._open()
    if self.generation is None:
      lost = self.prime()
      if lost is not None:
        return lost
    traffic.aside(len(data))
    w = kv.write(self.key, data, if_equal=self.generation).result(
        timeout=self.request_s)
    if w.generation:
      self.generation = bytes(w.generation)
      return None
    # The condition failed: ours all the same (a retried request), or gone.
    traffic.aside(len(data))
    r = kv.read(self.key).result(timeout=self.request_s)
    if r.state == "missing":
      return "its lease is gone"
    if not self._mine(bytes(r.value), count):
      return "its lease was replaced"
    self.generation = bytes(r.stamp.generation)
    return None

  def prime(self) -> str | None:
    """Reads the generation of the lease prepare wrote (once, before the
    first renewal is due); why the lease is lost, or None."""
    kv = self._open()
    traffic.aside(lease_lib.MAX_LEASE_BYTES)
    r = kv.read(self.key).result(timeout=self.request_s)
    if r.state == "missing" or not self._mine(bytes(r.value), 0, first=True):
      return "its lease is gone" if r.state == "missing" else (
          "its lease names another attempt")
    self.generation = bytes(r.stamp.generation)
    return None

  def _mine(self, data: bytes, count: int, first: bool = False) -> bool:
    lease = lease_lib.parse(data)
    if lease is None or lease.get("token") != self.token:
      return False
    n = lease.get("renewal", 0)
    return first or (type(n) is int and 0 <= n <= count)


class MarkerCommit:
  """Object stores and ``memory://``: commit by a create-only marker and a
  flat record (module docstring; ckpt/commit/protocol.py for the records)."""

  def __init__(self, storage: storage_lib.Storage):
    self.storage = storage

  # The shortest time between two renewals of a lease (a request).
  least_renewal_s = lease_lib.MIN_BUCKET_RENEWAL_S

  def lease(self, key: str, token: str, request_s: float) -> ObjectLease:
    return ObjectLease(self.storage, key, token, request_s)

  def work_dir(self, step: int, token: str) -> str:
    """The relative directory the attempt ``token`` at ``step`` writes into."""
    return (f"{names.step_dirname(step)}/{ATTEMPT_PREFIX}"
            f"{records.check_token(token)}")

  def write_into_attempt(self, work_dir: str, rel: str, data: bytes,
                         what: str) -> None:
    """A small object of this process into the attempt."""
    del what  # storage.write_bytes names the key in its errors
    self.storage.write_bytes(f"{work_dir}/{rel}", data)

  def is_committed(self, step: int) -> bool:
    storage = self.storage
    if records.records_complete(storage):
      return records.read_record(storage, step) is not None
    return storage.exists(f"{names.step_dirname(step)}/{names.COMMIT_MARKER}")

  def not_committed_reason(self, step: int) -> str | None:
    """None: a bucket has no directory to describe."""
    del step
    return None

  def committed_steps(self) -> list[int]:
    """One listing of ``commits/`` (a root not migrated yet: of every key
    under ``checkpoint_*``, see ckpt/commit/protocol.py)."""
    storage = self.storage
    found = [k[len(records.RECORDS):]
             for k in storage.list_keys(records.RECORDS)]
    if storage.records_complete or "complete" in found:
      storage.records_complete = True
      return sorted(int(n) for n in found if records.STEP_NAME_RE.match(n))
    return sorted(self.scan()[0])

  def attempts_with_index(self) -> list[str]:
    """The ``attempt-<token>/`` prefixes holding an index, when the storage
    URL is one step's directory copied without its marker."""
    storage = self.storage
    return sorted({k.split("/")[0] for k in storage.list_keys(ATTEMPT_PREFIX)
                   if k.endswith("/" + names.INDEX_NAME)
                   and records.ATTEMPT_DIR_RE.match(k.split("/")[0])
                   and k.count("/") == 1})

  def read_lease(self, key: str) -> tuple[bytes | None, bytes | None]:
    """(the lease's bytes or None, the generation that read saw)."""
    return self.storage.read_generation(key)

  # How an expired lease's age reads in a reason.
  stale_lease = "its lease was unchanged for {age:.0f} s"

  def clock(self, seen: lease_lib.Sightings | None) -> SightingsClock:
    return SightingsClock(self.storage, seen)

  def holds_nothing(self, rel: str) -> bool:
    """An attempt on a bucket is never an empty directory: False."""
    del rel
    return False

  def abandoned(self, live: Callable[[str], bool | None]) -> list[str]:
    """One listing of ``pending/``: the attempts ``live`` does not say are
    (an unknown age included) and the deletions that died; a root not
    migrated yet is also listed in full, as earlier versions did."""
    storage = self.storage
    out = []
    pending = records.list_pending(storage)
    for s, t in pending:
      if t == records.DELETE:
        continue
      rel = self.work_dir(s, t)
      if not live(rel):
        # remove() keeps the data of the attempt that committed s (its
        # pending record alone is left over) and drops a marker naming it
        # that never got its record.
        out.append(rel)
    # Deletions that died, by the name of their pending record: remove()
    # finishes what that record names, as it is when it does (never the
    # step as a whole: see ckpt/commit/deletion.py).
    out += [deletion.name(s) for s, t in pending
            if t == records.DELETE and deletion.unfinished(storage, s)]
    if not records.records_complete(storage):
      out += [r for r in self._abandoned_by_scan(live) if r not in out]
    return out

  def _abandoned_by_scan(self, live: Callable[[str], bool | None]) -> list[str]:
    """A root whose records are not complete: from one full listing."""
    out = []
    committed, attempts, loose = self.scan()
    for s, tokens in sorted(attempts.items()):
      winner = (records.commit_state(self.storage, s)[1] if s in committed
                else None)
      for t in sorted(tokens - {winner}):
        rel = self.work_dir(s, t)
        # A committed step's losing attempts go once their lease is over.
        if not live(rel):
          out.append(rel)
    # Keys of an uncommitted step outside any attempt: a save by ckpt < 0.2
    # that never committed (today's saves write only inside attempts).
    out += [names.step_dirname(s) for s in sorted(loose - committed)
            if s not in attempts]
    return out

  def finish_deletion(self, rel: str) -> bool:
    """``pending/<step>.delete`` (a name ``abandoned`` gives): finishes that
    deletion and returns True; False for any other name."""
    step = deletion.parse_name(rel)
    if step is None:
      return False
    deletion.finish(self.storage, step)
    return True

  def remove_leftovers(self, step: int) -> bool:
    """A whole step found abandoned by a full listing (a root without
    records) loses only the keys an earlier ckpt left beside no marker."""
    deletion.drop_leftovers(self.storage, step)
    return True

  def remove(self, rel: str, step: int | None, what: str) -> None:
    """A whole step: invisible first (its record and marker), then its
    data (ckpt/commit/deletion.py). One attempt: its lease first, then,
    unless it is the one committed, its marker if it never got its record,
    its keys and its ``pending/`` record."""
    storage = self.storage
    if step is not None:
      deletion.remove_step(storage, step)
      return
    head, _, tail = rel.partition("/")
    m = records.ATTEMPT_DIR_RE.match(tail)
    if not m:  # checkpoint_<step>.tmp-<id> (written to a disk, then copied)
      storage.delete_prefix(f"{rel}/", what)
      return
    # One attempt: checkpoint_<step>/attempt-<token>.
    step, token = names.parse_step(head), m.group(1)
    complete = records.records_complete(storage)
    committed, winner = records.commit_state(storage, step)
    if committed and winner == token:
      # The step itself (a commit that died before removing its pending
      # record, or a legacy root): only that record goes.
      storage.delete_key(records.pending_key(step, token))
      return
    # The lease goes first: a holder committing now checks it after writing
    # its record (``publish``), and the record is read again after this,
    # so one of the two sees the other: either that commit fails (and is
    # undone), or it is seen committed here and its data stays.
    storage.delete_key(f"{rel}/{ATTEMPT_FILE}")
    committed, winner = records.commit_state(storage, step)
    if committed and winner == token:
      storage.delete_key(records.pending_key(step, token))
      return
    if complete and not committed:
      marker = f"{names.step_dirname(step)}/{names.COMMIT_MARKER}"
      data, gen = storage.read_generation(marker)
      if records.marker_attempt(data) == token:
        # It never got its record: never listed. Only that marker: a commit
        # of another attempt may have replaced it since it was read.
        storage.delete_key(marker, generation=gen)
    storage.delete_prefix(f"{rel}/", what)
    storage.delete_key(records.pending_key(step, token))

  def pending_gone(self, step: int, token: str) -> str | None:
    """Why the attempt is not whole: its ``pending/`` record is gone."""
    key = records.pending_key(step, token)
    return None if self.storage.exists(key) else f"its record {key} is gone"

  def scan(self):
    """From ONE listing of every key under ``checkpoint_*`` (a root whose
    records are not complete): (committed steps, {step: attempt tokens},
    steps holding keys outside any attempt)."""
    committed, attempts, loose = set(), {}, set()
    for key in self.storage.list_keys(names.STEP_PREFIX):
      head, _, tail = key.partition("/")
      s = names.parse_step(head)
      if s is None or not tail:
        continue
      first, _, rest = tail.partition("/")
      m = records.ATTEMPT_DIR_RE.match(first)
      if tail == names.COMMIT_MARKER:
        committed.add(s)
      elif m and rest:
        attempts.setdefault(s, set()).add(m.group(1))
      else:
        loose.add(s)
    return committed, attempts, loose

  def ensure_records(self) -> None:
    """Process 0, before a save writes anything: makes ``commits/`` complete
    (see "Compatibility" in ckpt/commit/protocol.py). Costs one GET once
    the root is migrated (then nothing, for this Storage)."""
    storage = self.storage
    if records.records_complete(storage):
      return
    committed, attempts, loose = self.scan()  # the one full listing
    winners = {}
    for s in sorted(committed):
      key = f"{names.step_dirname(s)}/{names.COMMIT_MARKER}"
      data = storage.read_bytes(key)
      if data is None:
        continue  # deleted meanwhile
      token, data_dir = records.parse_marker(
          data, f"{storage.url.rstrip('/')}/{key}")
      winners[s] = token
      rel = names.step_dirname(s) + (f"/{data_dir}" if data_dir else "")
      t = metrics = None
      temporary = False
      try:
        index = storage.read_bytes(storage.index_key(rel))
        if index is not None:
          t, metrics, temporary = index_info(index)
      except CheckpointError as e:
        logging.warning("ckpt: migrating %s: the index of step %d is "
                        "unreadable (%s); its record holds no metrics",
                        storage.url, s, e)
      storage.write_bytes(records.record_key(s),
                          records.record(s, token, data_dir, t, metrics,
                                         temporary))
    for s, tokens in sorted(attempts.items()):
      for t in sorted(tokens - {winners.get(s)}):
        # its attempt.json says more
        records.write_pending(storage, s, t, time_s=0.0)
    for s in sorted(loose - committed - set(attempts)):
      # Keys of an uncommitted step outside any attempt: a save by ckpt < 0.2
      # that never committed (its deletion deletes only those).
      records.write_pending(storage, s, records.DELETE, time_s=0.0,
                            deletes=(None, ""))
    storage.write_bytes(records.RECORDS_COMPLETE, json.dumps(
        {"records": "complete", "migrated_steps": len(committed),
         "time": time.time()}).encode() + b"\n")
    storage.records_complete = True

  def start_attempt(self, step: int, token: str, lease_s: float,
                    seen: lease_lib.Sightings | None, cleaner: Cleaner) -> str:
    """The attempt's ``pending/`` record, then its lease; the root's
    records are made complete and a stale marker of ``step`` goes first.
    Returns the attempt's relative path."""
    storage = self.storage
    rel = self.work_dir(step, token)
    try:
      self.ensure_records()
    except CheckpointError as e:
      # The root stays as it is (discovered by full listings); this save
      # goes on, and the next one tries again.
      logging.warning("ckpt: could not make the commit records of %s "
                      "complete: %s", storage.url, e)
    self.clear_stale_marker(step, lease_s, cleaner, seen)
    # first: cleanup can find the rest
    records.write_pending(storage, step, token)
    storage.write_bytes(f"{rel}/{ATTEMPT_FILE}", lease_lib.make(token))
    return rel

  def clear_stale_marker(self, step: int, lease_s: float, cleaner: Cleaner,
                         seen: lease_lib.Sightings | None = None) -> None:
    """Process 0, preparing a save of ``step`` (no record, records
    complete): a marker left without a record (a commit or a deletion that
    died half way) would make this attempt's commit fail. It goes when that
    is provably no live commit: the step's deletion is pending, or the
    attempt the marker names has no live lease (``seen``: this cleaner's
    earlier sightings of leases, ckpt/commit/lease.py). One GET when there
    is no such marker."""
    storage = self.storage
    if not records.records_complete(storage):
      return  # without records, a marker is a commit
    key = f"{names.step_dirname(step)}/{names.COMMIT_MARKER}"
    if (not storage.exists(key)
        or records.read_record(storage, step) is not None):
      return
    if storage.exists(deletion.name(step)):
      # Finish that deletion: it removes the marker only if it names the
      # commit that deletion deletes.
      deletion.finish(storage, step)
      if not storage.exists(key):
        return
    data, gen = storage.read_generation(key)
    won = records.marker_attempt(data)
    if data is None or (won is not None and cleaner.is_live(
        storage, self.work_dir(step, won), lease_s, seen)):
      return  # maybe a commit in progress: if it is, ours fails, naming it
    logging.warning("ckpt: step %d in %s has a commit marker but no commit "
                    "record (a save that died while committing); removing "
                    "that attempt (%s)", step, storage.url, won)
    if won is None:
      storage.delete_key(key, generation=gen)
    else:
      cleaner.remove(storage, self.work_dir(step, won))

  def publish(self, step: int, token: str, index_data: bytes,
              lease_gen: bytes | None) -> None:
    """Writes the index, the create-only marker, then the record (which
    makes the step visible), checks the attempt is still whole (undoing
    the record and marker if not), then drops its ``pending/`` record."""
    storage = self.storage
    rel = self.work_dir(step, token)
    final = names.step_dirname(step)
    where = f"{storage.url.rstrip('/')}/{rel}"
    storage.write_bytes(f"{rel}/{names.INDEX_NAME}", index_data)
    marker_key = f"{final}/{names.COMMIT_MARKER}"
    data_dir = rel.split("/", 1)[1]
    with storage.store_errors(f"writing the commit marker of step {step} to"):
      storage.result(storage.kv.write(
          marker_key, records.marker(step, token, data_dir),
          if_equal=NO_VALUE))
    # A write whose condition failed is not an error in TensorStore; a
    # retried PUT of ours may also find our own marker. Read which won.
    if records.marker_attempt(storage.read_bytes(marker_key)) != token:
      raise committed_elsewhere(storage, step, where)
    t, metrics, temporary = index_info(index_data)
    # The record makes the step visible; then the attempt is no longer
    # pending.
    rec_gen = storage.write_bytes(
        records.record_key(step), records.record(step, token, data_dir, t,
                                                 metrics, temporary))
    why = self._still_whole(step, token, lease_gen)
    if why is not None:  # undone: the record, then the marker, if still ours
      storage.delete_key(records.record_key(step), generation=rec_gen)
      data, gen = storage.read_generation(marker_key)
      if records.marker_attempt(data) == token:
        storage.delete_key(marker_key, generation=gen)
      raise removed_error(step, where, why)
    try:
      storage.delete_key(records.pending_key(step, token))
    except CheckpointError as e:  # committed all the same; cleanup drops it
      logging.warning("ckpt: step %d is committed, but removing %s failed: "
                      "%s", step, records.pending_key(step, token), e)

  def _still_whole(self, step: int, token: str,
                   lease_gen: bytes | None) -> str | None:
    """After the record is written: why the attempt is no longer whole
    (None: it is). A cleaner removes the lease first and reads the record
    after (ckpt/commit/cleanup.py): one of the two sees the other."""
    rel = self.work_dir(step, token)
    data, gen = self.storage.read_generation(f"{rel}/{ATTEMPT_FILE}")
    if data is None:
      return "its lease was removed while it committed"
    if lease_gen is not None and gen != lease_gen:
      return "its lease was rewritten while it committed"
    if not self.storage.exists(records.pending_key(step, token)):
      return (f"its record {records.pending_key(step, token)} was removed "
              "while it committed")
    return None


def index_info(index_data: bytes
               ) -> tuple[float | None, dict | None, bool]:
  """(time, metrics, temporary) from an encoded index, reading only its
  top-level map (best effort: None, None, False if it cannot)."""
  found: dict = {}
  try:
    u = msgpack.Unpacker(raw=False, strict_map_key=False,
                         max_buffer_size=max(len(index_data), 1))
    u.feed(index_data)
    for _ in range(u.read_map_header()):
      k = u.unpack()
      if k in ("time", "metrics", "temporary"):
        found[k] = u.unpack()
      elif k == "structure":  # the three come before it (index.encode)
        break
      else:
        u.skip()
    t = found.get("time")
    t = float(t) if type(t) in (int, float) and math.isfinite(t) else None
    return (t, records.check_metrics(found.get("metrics"), "the index"),
            found.get("temporary") is True)
  except Exception:  # pylint: disable=broad-except
    return None, None, False
