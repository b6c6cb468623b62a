"""The trainer's side of its host's writer process (``writer="process"``).

``WriterProcess`` owns the process (ckpt/save/writer_main.py), started at
the first save that needs it and again after one died, and the socket to
it; a reader thread hands each reply to the save it belongs to (its
``job``), and tells that save when the writer is gone. Call sequence:
``ensure_started()``, ``begin(on_message)`` (a job number), ``send(...)``
for that job, ``end(job)``; ``close()`` at the Checkpointer's close.
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable

from absl import logging

from ckpt.errors import CheckpointError
from ckpt.save import handover
from ckpt.save import polite

CLOSE_WAIT_S = 600.0  # close() waits this long for a save being finished
# The module the writer runs (``python -m``); tests run one that wraps it.
WRITER_MODULE = "ckpt.save.writer_main"


class WriterProcess:
  """This host's writer process (see the module docstring)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._proc: subprocess.Popen | None = None
    self._channel: handover.Channel | None = None
    self._handlers: dict[int, Callable[[dict | None], None]] = {}
    self._jobs = itertools.count()
    self._closed = False
    self.nonce = secrets.token_hex(4)  # in its segments' names
    self._segments = itertools.count()

  def segment_name(self) -> str:
    return handover.segment_name(self.nonce, self.pid or 0,
                                 next(self._segments))

  @property
  def pid(self) -> int | None:
    proc = self._proc
    return None if proc is None else proc.pid

  def ensure_started(self) -> None:
    with self._lock:
      if self._closed:
        raise CheckpointError("the Checkpointer's writer process was closed")
      if self._proc is not None and self._proc.poll() is None:
        return
      mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
      env = dict(os.environ)
      # No device: the writer writes bytes (jax is imported, never run).
      env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="",
                 TPU_VISIBLE_CHIPS="")
      # Below the trainer's priority, as the thread writer's threads are
      # (ckpt/save/polite.py; BACKGROUND_NICE = 0: at the trainer's).
      env[handover.NICE_ENV] = str(polite.background_nice())
      try:
        # A new interpreter (never a fork of this JAX process), in its own
        # session: a Ctrl-C or a kill of the trainer's group spares it.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", WRITER_MODULE,
             str(theirs.fileno()), str(os.getpid()), self.nonce],
            pass_fds=(theirs.fileno(),), env=env, start_new_session=True,
            stdin=subprocess.DEVNULL)
      finally:
        theirs.close()
      self._channel = channel = handover.Channel(mine)
      threading.Thread(target=self._read, args=(channel, self._proc),
                       name="ckpt-writer-reader", daemon=True).start()

  def begin(self, on_message: Callable[[dict | None], None]) -> int:
    """A new job: ``on_message(m)`` gets each of its replies on the reader
    thread, and None once the writer is gone."""
    job = next(self._jobs)
    with self._lock:
      self._handlers[job] = on_message
    return job

  def end(self, job: int) -> None:
    with self._lock:
      self._handlers.pop(job, None)

  def send(self, kind: str, **fields) -> None:
    channel = self._channel
    try:
      if channel is None:
        raise OSError("not started")
      channel.send(kind, **fields)
    except OSError as e:
      raise CheckpointError(
          f"the writer process (pid {self.pid}) of this host is gone "
          f"({self.describe_end()}): {e}") from e

  def exited(self) -> bool:
    """Whether the writer process has ended (reaped: nothing of it runs)."""
    proc = self._proc
    return proc is not None and proc.poll() is not None

  def describe_end(self) -> str:
    proc = self._proc
    code = None if proc is None else proc.poll()
    if code is None:
      return "its socket closed"
    if code < 0:
      try:
        return f"killed by {signal.Signals(-code).name}"
      except ValueError:
        return f"killed by signal {-code}"
    return f"exit code {code}"

  def _read(self, channel: handover.Channel, proc: subprocess.Popen) -> None:
    while True:
      try:
        m = channel.receive()
      except (ValueError, OSError) as e:
        logging.error("ckpt: the writer process sent a bad message: %s", e)
        m = None
      if m is None:
        break
      with self._lock:
        handler = self._handlers.get(m.get("job"))
      if handler is not None:
        handler(m)
    try:  # gone: every job hears it
      proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      pass
    handover.sweep(os.getpid(), self.nonce)  # handed over, never unlinked
    with self._lock:
      handlers = list(self._handlers.values())
      self._handlers.clear()
    for handler in handlers:
      handler(None)
    channel.close()

  def close(self) -> None:
    """Lets the writer finish what it was handed, then ends it."""
    with self._lock:
      self._closed = True
      proc, channel = self._proc, self._channel
    if proc is None:
      return
    try:
      if channel is not None:
        channel.send("exit")
    except OSError:
      pass
    try:
      proc.wait(timeout=CLOSE_WAIT_S)
    except subprocess.TimeoutExpired:
      logging.error("ckpt: the writer process (pid %d) did not end within "
                    "%g s of close(); killing it", proc.pid, CLOSE_WAIT_S)
      proc.kill()
      proc.wait()
    handover.sweep(os.getpid(), self.nonce)
