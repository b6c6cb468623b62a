"""The coordination service's client, every call timed and bounded.

Why bounded, and how: see ckpt/multihost/process.py's docstring (a frozen
process 0 leaves the others' calls unanswered; each call runs on a daemon
thread and the caller waits for it with a bound). Here: ``BoundedClient``
(the client's calls, timed into this process's totals and bounded), the
totals themselves (``coordination_stats``, ``trace_coordination``).
Imports nothing of ckpt but its errors.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax
from jax._src import distributed as _distributed

from ckpt.errors import BarrierTimeoutError

# The longest a call without a timeout of its own may go unanswered by the
# coordination service (and the period of the questions asked during a
# long wait); at most the collective call's own timeout.
ANSWER_S = 30.0
# How long after its own timeout a barrier or blocking get is given up
# when the service does not end it itself.
GRACE_S = 5.0
_PROBE_KEY = "ckpt/alive"  # never set: asking for it costs one answer


# ---- what coordination costs --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CoordinationStats:
  """Calls into the coordination service made by this process, and the
  wall time spent inside them (waiting for other processes included).

  ``barriers`` counts ``wait_at_barrier``; ``kv_calls`` every key-value
  call (set, get, blocking get, dir get, delete; bytes variants too).
  """
  seconds: float = 0.0
  barriers: int = 0
  barrier_s: float = 0.0
  kv_calls: int = 0
  kv_s: float = 0.0

  def __sub__(self, other: "CoordinationStats") -> "CoordinationStats":
    return CoordinationStats(*(a - b for a, b in zip(
        dataclasses.astuple(self), dataclasses.astuple(other))))


_coord = [0.0, 0, 0.0, 0, 0.0]  # the fields of CoordinationStats
_coord_lock = threading.Lock()
_trace: list | None = None  # (method, first argument, start, seconds)


def coordination_stats(reset: bool = False) -> CoordinationStats:
  """This process's totals since it started (or the last reset); every
  thread's calls count, so take a delta around what you measure."""
  with _coord_lock:
    out = CoordinationStats(*_coord)
    if reset:
      _coord[:] = [0.0, 0, 0.0, 0, 0.0]
  return out


def trace_coordination(enabled: bool) -> list:
  """Starts (True) or stops (False) recording every call as ``(method,
  first argument, perf_counter at start, seconds)``; returns what was
  recorded since the last start. For benchmarks: off by default."""
  global _trace
  with _coord_lock:
    got, _trace = (_trace or []), ([] if enabled else None)
  return got


def record(method: str, arg: Any, start: float, seconds: float) -> None:
  with _coord_lock:
    _coord[0] += seconds
    if method == "wait_at_barrier":
      _coord[1] += 1
      _coord[2] += seconds
    else:
      _coord[3] += 1
      _coord[4] += seconds
    if _trace is not None:
      _trace.append((method, str(arg)[:200], start, seconds))


class BoundedClient:
  """The distributed client, with every call timed into the totals above
  and bounded (module docstring)."""

  __slots__ = ("_client", "_answer_s")

  def __init__(self, client, timeout_s: float):
    self._client = client
    self._answer_s = max(0.001, min(ANSWER_S, float(timeout_s)))

  def __getattr__(self, name: str):
    attr = getattr(self._client, name)
    if not callable(attr) or not (name == "wait_at_barrier" or
                                  "key_value" in name):
      return attr

    def timed(*args, **kwargs):
      start = time.perf_counter()
      try:
        return self._bounded(name, attr, args, kwargs)
      finally:
        record(name, args[0] if args else "", start,
                time.perf_counter() - start)
    return timed

  def _bounded(self, name: str, fn, args, kwargs):
    first = args[0] if args else ""
    own = None  # the call's own timeout, for those that have one
    if name == "wait_at_barrier" or name.startswith("blocking_key_value_get"):
      own = (args[1] if len(args) > 1 else kwargs.get("timeout_in_ms")) / 1000
    call = Call(fn, args, kwargs)
    if own is None:
      if not call.done.wait(self._answer_s):
        raise call.unanswered(f"{name}({str(first)[:200]!r})",
                              self._answer_s)
      return call.result()
    end = time.monotonic() + own + GRACE_S
    while not call.done.wait(max(0.0, min(self._answer_s,
                                          end - time.monotonic()))):
      left = end - time.monotonic()
      if left <= 0:
        raise call.unanswered(f"{name}({str(first)[:200]!r})",
                              own + GRACE_S)
      # Is the service there at all? (NOT_FOUND is its answer.) The
      # question waits no longer than the call's own bound has left.
      probe = Call(self._client.key_value_try_get, (_PROBE_KEY,), {})
      if not probe.done.wait(min(self._answer_s, left)):
        if left < self._answer_s:  # the call's bound came first
          raise call.unanswered(f"{name}({str(first)[:200]!r})",
                                own + GRACE_S)
        raise probe.unanswered(
            f"a question (key_value_try_get) asked while {name}"
            f"({str(first)[:200]!r}) waited", self._answer_s)
    return call.result()


_silent: set = set()  # calls given up unanswered, while they stay so
_silent_lock = threading.Lock()


class Call:
  """One call into the coordination service, on a daemon thread (left
  behind, waiting, if the service never answers it)."""

  def __init__(self, fn, args, kwargs):
    self.done = threading.Event()
    self._value = self._error = None
    with _silent_lock:
      silent = next(iter(_silent), None)
    self.error = None
    if silent is not None:  # the service is not answering: no new call
      self._error = BarrierTimeoutError(str(silent.error))
      self._error.late = [0]
      self.done.set()
      return
    threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True,
                     name="ckpt-coordination").start()

  def _run(self, fn, args, kwargs) -> None:
    try:
      self._value = fn(*args, **kwargs)
    except BaseException as e:  # pylint: disable=broad-except
      self._error = e
    finally:
      self.done.set()
      with _silent_lock:
        _silent.discard(self)  # answered after all

  def result(self):
    if self._error is not None:
      raise self._error
    return self._value

  def unanswered(self, asked: str, bound_s: float) -> BarrierTimeoutError:
    """The error of a call (``asked``) given up after ``bound_s``; until the
    service answers it, every new call raises it too."""
    address = getattr(_distributed.global_state, "coordinator_address", None)
    e = BarrierTimeoutError(
        f"process {jax.process_index()} of {jax.process_count()}: the coordination "
        f"service, which process 0 runs{f' at {address}' if address else ''}"
        f", did not answer {asked} within {bound_s:g} s: "
        "process 0 is stopped, frozen or dead (or the network to it is "
        "down); processes that did not answer: [0]. Look at process 0 (its "
        "logs, whether it runs); this process gives up instead of waiting "
        "for JAX's heartbeat to abort it")
    e.late = [0]
    self.error = e
    with _silent_lock:
      if not self.done.is_set():
        _silent.add(self)
    return e


