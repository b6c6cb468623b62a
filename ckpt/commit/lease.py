"""Who holds a save attempt, and when another job may take it for dead.

An attempt's ``attempt.json`` is its lease. Process 0 of the saving job
writes it when it prepares the attempt and renews it every
``renew_interval(lease_s)`` seconds while the save runs, on a thread and a
kvstore of its own (ckpt/commit/renewal.py), each renewal conditional on
the lease it wrote last, so a removed attempt is never recreated. It names
its holder: the host name, the kernel's boot id and pid namespace, the pid
of process 0 and that process's start time, the job's coordinator address
and process count, and a renewal number (the holder's clock time is in it
too, for people; no cleaner reads it).

Cleanup (``commit.abandoned``, run by process 0 at every save) removes an
attempt when one of these holds:

- its holder is provably dead: the lease was written on this machine (same
  host name, same boot, same pid namespace, so the pid means the same
  process) and that process is gone: no such pid, a zombie, or a pid reused
  by a process that started later. A job restarted on the host of its
  crashed predecessor's process 0 removes that job's attempt at its first
  save, whatever its age;
- its lease is older than ``lease_s`` (default 30 s): the holder runs on
  another host (nothing here can see its processes), or it is alive but
  stopped renewing (its save failed or hangs).

The age of a lease is read on ONE clock, never by comparing one host's
``time.time()`` with another's (a holder whose clock is 2 minutes behind
would lose its live attempt; one a year ahead would never be cleaned):

- POSIX: the file system's clock. The age is the modification time of a
  probe file the cleaner creates now in the root minus that of the lease
  (of the attempt directory when it has no lease yet): both stamped by the
  same kernel (a local disk) or file server (NFS sets times on the
  server), whatever the clocks of the holder and the cleaner say;
- object stores: the cleaner's own monotonic clock (``Sightings``): the
  time since the cleaner first saw the lease's current generation (its
  ``pending/`` record's when it has no lease). A renewal changes the
  generation, so a live save is never seen unchanged for ``lease_s``; a
  cleaner's first look at an attempt proves nothing, and the attempt goes
  at the first cleanup at least ``lease_s`` later that finds it unchanged
  (a Checkpointer remembers what it saw from one save to the next; ``ckpt
  gc`` watches for that long).

Nothing else counts as proof. In particular a job that now holds the old
job's coordinator address proves nothing: gRPC binds with SO_REUSEPORT, so a
second coordination service binds a port a live one still holds (checked
with jax 0.10's ``get_distributed_runtime_service``). Without /proc (not
Linux) only the age rule applies.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
from typing import Any, Callable

DEFAULT_LEASE_S = 30.0
# What a lease holds at most, for what its reads are announced as
# (ckpt/store/traffic.py): make() writes some 400 bytes.
MAX_LEASE_BYTES = 4096
# GCS allows about one update a second of one object: renewals never come
# faster than this on an object store, whatever lease_s says.
MIN_BUCKET_RENEWAL_S = 1.0


def renew_interval(lease_s: float, least_s: float) -> float:
  """Seconds between two renewals of a lease that expires after
  ``lease_s``: six renewals a lease, so one or two late ones never let it
  expire under a live save; at least ``least_s`` (the medium's: a file
  0.05 s, an object MIN_BUCKET_RENEWAL_S)."""
  return max(lease_s / 6, least_s)


def _read_text(path: str) -> str | None:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return None


def _proc_start(pid: int) -> tuple[str, int] | None:
  """(state letter, start time in clock ticks after boot) of ``pid``, from
  /proc/<pid>/stat; None if there is no such process (or no /proc)."""
  stat = _read_text(f"/proc/{pid}/stat")
  if stat is None:
    return None
  fields = stat[stat.rfind(")") + 2:].split()  # the name may hold spaces
  try:
    return fields[0], int(fields[19])
  except (IndexError, ValueError):
    return None


@functools.lru_cache(maxsize=None)
def _machine() -> tuple[str, str | None, str | None]:
  try:
    pidns = os.readlink("/proc/self/ns/pid")
  except OSError:
    pidns = None
  return (socket.gethostname(),
          _read_text("/proc/sys/kernel/random/boot_id"), pidns)


def holder() -> dict[str, Any]:
  """This process as the holder of a lease (process 0 of its job)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  host, boot, pidns = _machine()
  pid = os.getpid()
  started = _proc_start(pid)
  state = distributed.global_state
  return {"host": host, "boot": boot, "pidns": pidns, "pid": pid,
          "pid_start": None if started is None else started[1],
          "coordinator": state.coordinator_address,
          "processes": state.num_processes or 1}


def make(token: str, renewal: int = 0) -> bytes:
  """The content of a lease taken (``renewal`` 0) or renewed now by this
  process; every renewal's content differs (its number), so its storage
  generation does."""
  return json.dumps({"token": token, "renewal": renewal, "time": time.time(),
                     **holder()}).encode()


class Sightings:
  """A cleaner's own clock for leases it cannot date (object stores): when
  it first saw each lease in the generation it has now. Kept by a
  Checkpointer from one save's cleanup to the next; thread-safe."""

  def __init__(self, clock: Callable[[], float] = time.monotonic):
    self._clock = clock
    self._seen: dict[str, tuple[bytes, float]] = {}
    self._lock = threading.Lock()

  def unchanged_for(self, key: str, generation: bytes) -> float:
    """Seconds since ``key`` was first seen holding ``generation`` (0 at
    the first sight of that generation)."""
    now = self._clock()
    with self._lock:
      seen = self._seen.get(key)
      if seen is None or seen[0] != generation:
        self._seen[key] = (generation, now)
        return 0.0
      return now - seen[1]

  def keep_only(self, keys) -> None:
    """Forgets every lease but ``keys`` (those still pending)."""
    keys = set(keys)
    with self._lock:
      for k in [k for k in self._seen if k not in keys]:
        del self._seen[k]


def parse(data: bytes | None) -> dict | None:
  """A lease as written by ``make`` (older ckpt wrote token, time, host and
  pid only); None if ``data`` is missing or not a JSON object."""
  if data is None:
    return None
  try:
    out = json.loads(data)
  except ValueError:
    return None
  return out if isinstance(out, dict) else None


def dead_reason(lease: dict) -> str | None:
  """Why the holder of ``lease`` is provably dead; None if it may be alive
  (or this machine cannot tell)."""
  host, boot, pidns = _machine()
  pid, start = lease.get("pid"), lease.get("pid_start")
  if (lease.get("host") != host or boot is None or lease.get("boot") != boot
      or pidns is None or lease.get("pidns") != pidns
      or type(pid) is not int or type(start) is not int):
    return None  # written elsewhere, or by a ckpt that did not say enough
  now = _proc_start(pid)
  where = f"pid {pid} on this host ({host})"
  if now is None:
    return f"its holder ({where}) has exited"
  if now[0] in ("Z", "X"):
    return f"its holder ({where}) has exited (a zombie)"
  if now[1] != start:
    return f"its holder ({where}) has exited; the pid now belongs to another process"
  return None
