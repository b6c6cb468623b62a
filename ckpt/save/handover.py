"""What a trainer and its writer process (``writer="process"``) exchange.

Two parts, no jax: the messages and the shared memory.

Messages are msgpack maps (never pickle), each framed by its length (4
bytes, big-endian), over one Unix socket pair: the trainer's end and the
writer's. A closed end (EOF) means the other process is gone.

Trainer to writer: ``begin`` (a save: its storage URL and options, step,
attempt, the arrays to create or open with their TensorStore specs, the
host files, whether the writer commits and the lease), ``box`` (one staged
box: its array, start, stop, dtype, and the shared-memory segment that
holds it), ``flush`` (format "ocdbt": write the boxes handed over since
the last flush, in one transaction), ``finish`` (every box handed over;
the index when the writer commits), ``cancel``, ``exit``. Writer to trainer: ``held`` (process 0's
writer holds the attempt's lease: its trainer's ``save()`` returns only
after it), ``freed`` (a box was
written, or a batch of them: their bytes go back to the save's budget), ``done`` (the boxes
written and durable, the files written, committed or not), ``failed``
(an error: its class name and message), ``cancelled``.

Shared memory: one file under ``/dev/shm`` per staged box, named
``ckpt-<trainer pid>-<writer nonce>-<writer pid>-<n>``: the trainer
creates it and copies the box into it (the staging copy, the only one), the writer maps it, writes
from the mapping and unlinks it once written. Every path unlinks: the
writer what it was handed (written, failed, cancelled, or its trainer
dead), the trainer what it staged but did not hand over, ``sweep`` what a
trainer and writer that both died left (both pids gone: another writer of
the host may still be reading what a dead trainer handed it).
"""

from __future__ import annotations

import mmap
import os
import re
import socket
import struct
import threading
from typing import Any

import msgpack
import numpy as np

SHM_DIR = "/dev/shm"
_PREFIX = "ckpt-"
_NAME = re.compile(r"ckpt-(\d+)-([0-9a-f]+)-(\d+)-\d+$")
MAX_MESSAGE_BYTES = 1 << 30
# The writer's nice value, set by its trainer in its environment (the
# writer lowers every thread of its own to it: ckpt/save/polite.py).
NICE_ENV = "CKPT_WRITER_NICE"
_LEN = struct.Struct(">I")


class Channel:
  """One end of the socket pair: whole messages in and out (``send`` may be
  called from several threads)."""

  def __init__(self, sock: socket.socket):
    self.sock = sock
    self._send_lock = threading.Lock()

  def send(self, kind: str, **fields: Any) -> None:
    data = msgpack.packb({"kind": kind, **fields}, use_bin_type=True)
    with self._send_lock:
      self.sock.sendall(_LEN.pack(len(data)) + data)

  def receive(self) -> dict | None:
    """The next message; None at EOF (the other end is gone)."""
    head = self._read(_LEN.size)
    if head is None:
      return None
    n, = _LEN.unpack(head)
    if n > MAX_MESSAGE_BYTES:
      raise ValueError(f"a hand-over message of {n} bytes (at most "
                       f"{MAX_MESSAGE_BYTES})")
    body = self._read(n)
    if body is None:
      return None
    got = msgpack.unpackb(body, raw=False, strict_map_key=False)
    if not isinstance(got, dict) or not isinstance(got.get("kind"), str):
      raise ValueError(f"a hand-over message that is not a map: {got!r:.100}")
    return got

  def _read(self, n: int) -> bytes | None:
    parts, left = [], n
    while left:
      try:
        got = self.sock.recv(min(left, 1 << 20))
      except (ConnectionResetError, OSError):
        return None
      if not got:
        return None
      parts.append(got)
      left -= len(got)
    return b"".join(parts)

  def close(self) -> None:
    try:
      self.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    self.sock.close()


def segment_name(nonce: str, writer: int, n: int) -> str:
  """The name of segment ``n`` for this trainer's writer ``nonce`` (whose
  process is ``writer``)."""
  return f"{_PREFIX}{os.getpid()}-{nonce}-{writer}-{n}"


class Segment:
  """One box's shared memory, created by the trainer (``create``) or mapped
  by the writer (``attach``)."""

  def __init__(self, name: str, nbytes: int, create: bool):
    if not _NAME.match(name):
      raise ValueError(f"not a ckpt shared-memory name: {name!r}")
    self.name, self.nbytes = name, nbytes
    path = os.path.join(SHM_DIR, name)
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
      if create:
        os.ftruncate(fd, max(nbytes, 1))
      elif os.fstat(fd).st_size < nbytes:
        raise ValueError(f"shared memory {name!r} holds "
                         f"{os.fstat(fd).st_size} bytes, {nbytes} expected")
      self._map = mmap.mmap(fd, max(nbytes, 1))
    except BaseException:
      os.close(fd)
      if create:
        unlink(name)
      raise
    os.close(fd)

  def array(self, shape, dtype) -> np.ndarray:
    return np.ndarray(tuple(shape), dtype=np.dtype(dtype), buffer=self._map)

  def close(self) -> None:
    try:
      self._map.close()
    except BufferError:  # a view still alive: the mapping goes with it
      pass


def write_segment(name: str, data: memoryview | list[memoryview]) -> None:
  """A new segment ``name`` holding ``data`` (bytes, or parts written one
  after the other), written with write(2)."""
  if not _NAME.match(name):
    raise ValueError(f"not a ckpt shared-memory name: {name!r}")
  fd = os.open(os.path.join(SHM_DIR, name),
               os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
  try:
    for part in data if isinstance(data, list) else [data]:
      part, done = memoryview(part).cast("B"), 0
      while done < len(part):
        done += os.write(fd, part[done:done + (256 << 20)])
  except BaseException:
    os.close(fd)
    unlink(name)
    raise
  os.close(fd)


def unlink(name: str) -> None:
  try:
    os.unlink(os.path.join(SHM_DIR, name))
  except FileNotFoundError:
    pass


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def sweep(of_pid: int | None = None, nonce: str | None = None,
          spare: int | None = None) -> int:
  """Unlinks the segments of trainer ``of_pid``'s writer ``nonce`` (None:
  those whose trainer and writer are both gone, but trainer ``spare``'s);
  how many."""
  n = 0
  try:
    names = os.listdir(SHM_DIR)
  except FileNotFoundError:
    return 0
  for name in names:
    m = _NAME.match(name)
    if m is None:
      continue
    pid, writer = int(m.group(1)), int(m.group(3))
    if ((pid == of_pid and m.group(2) == nonce) if of_pid is not None
        else pid != spare and not _alive(pid) and not _alive(writer)):
      unlink(name)
      n += 1
  return n


def error_message(e: BaseException) -> dict:
  """An error as a ``failed`` message carries it (see ``rebuild``)."""
  return {"type": type(e).__name__, "message": str(e)}


def rebuild(got: dict) -> Exception:
  """The error a ``failed`` message carries, in its own class when that is
  one of ckpt's or a builtin exception, else a CheckpointError naming it."""
  from ckpt import errors  # pylint: disable=import-outside-toplevel
  import builtins  # pylint: disable=import-outside-toplevel
  name, message = str(got.get("type")), str(got.get("message"))
  cls = getattr(errors, name, None) or getattr(builtins, name, None)
  if isinstance(cls, type) and issubclass(cls, Exception):
    try:
      return cls(message)
    except Exception:  # pylint: disable=broad-except
      pass
  return errors.CheckpointError(f"{name}: {message}")
