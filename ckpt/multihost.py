"""Process identity, barriers and small broadcasts: the only multi-host module.

Everything goes through the ``jax.distributed`` client, so it works the same
on a TPU pod and on N local CPU processes started with
``jax.distributed.initialize(coordinator_address="127.0.0.1:<port>", ...)``.
These calls block, use no device collectives, and are safe to call from the
Checkpointer's background thread.
"""

from __future__ import annotations

import itertools
import re
import secrets
import signal
import threading

import jax
from jax._src import distributed as _distributed

from ckpt.errors import BarrierTimeoutError

DEFAULT_TIMEOUT_S = 600.0
_instance_counter = itertools.count()


def process_index() -> int:
  return jax.process_index()


def process_count() -> int:
  return jax.process_count()


def _client():
  return _distributed.global_state.client


def is_multiprocess() -> bool:
  return process_count() > 1 and _client() is not None


def next_instance_id() -> int:
  """A number that is the same on every process for the n-th Checkpointer.

  SPMD programs create Checkpointers in the same order everywhere, so this
  gives every process the same key prefix without any communication.
  """
  return next(_instance_counter)


def barrier(name: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
            what: str = "") -> None:
  """Blocks until every process calls barrier(name); names must be unique."""
  if not is_multiprocess():
    return
  try:
    _client().wait_at_barrier(name, int(timeout_s * 1000))
  except Exception as e:  # jaxlib raises its own XlaRuntimeError type
    late = _late_processes(str(e))
    raise BarrierTimeoutError(
        f"barrier {name!r} ({what or 'ckpt'}) failed after {timeout_s:.0f}s "
        f"on process {process_index()} of {process_count()}; processes that "
        f"did not arrive: {late or 'unknown'}. Check that every process "
        f"called the same save/restore with the same step, and look at the "
        f"logs of the late processes. Cause: {e}") from e


def _late_processes(message: str) -> list[int]:
  m = re.search(r"timed out task names:\s*([\s\S]*?)(?:\n\n|$)", message)
  if not m:
    return []
  return sorted({int(x) for x in re.findall(r"(?:task[:_ ]?)?(\d+)", m.group(1))})


def _wait_for_key(get, key: str, timeout_s: float, what: str):
  try:
    return get(key, int(timeout_s * 1000))
  except Exception as e:  # jaxlib's own error type
    raise BarrierTimeoutError(
        f"process {process_index()} waited {timeout_s:.0f}s for {key!r} "
        f"({what}) and it never came; the process that should have set it "
        f"is late, stuck or dead. Cause: {e}") from e


def broadcast_str(key: str, make_value, *,
                  timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "") -> str:
  """Process 0 computes ``make_value()``; every process returns it."""
  if not is_multiprocess():
    return make_value()
  client = _client()
  if process_index() == 0:
    value = make_value()
    client.key_value_set(key, value)
    return value
  return _wait_for_key(client.blocking_key_value_get, key, timeout_s,
                       f"{what or 'a value'} from process 0")


def unique_token() -> str:
  return secrets.token_hex(6)


def gather_bytes(key: str, data: bytes, timeout_s: float = DEFAULT_TIMEOUT_S,
                 what: str = "data") -> list[bytes] | None:
  """Process 0 gets every process's ``data`` in process order; others None."""
  if not is_multiprocess():
    return [data]
  client = _client()
  client.key_value_set_bytes(f"{key}/{process_index()}", data)
  if process_index() != 0:
    return None
  return [_wait_for_key(client.blocking_key_value_get_bytes, f"{key}/{p}",
                        timeout_s, f"{what} from process {p}")
          for p in range(process_count())]


_sigterm_seen = threading.Event()
_sigterm_installed = False


def reached_preemption_sync_point(step: int) -> bool:
  """True, on every process at the same step, once a preemption notice came.

  Multi-process: jax's preemption sync manager (started by
  ``jax.distributed.initialize``) hears SIGTERM (or the cluster's notice) on
  any process and agrees on the first step every process can still reach.
  Single process: a SIGTERM handler installed on the first call.
  Call it at every step, from the main thread.
  """
  if is_multiprocess() and _distributed.global_state.preemption_sync_manager:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return multihost_utils.reached_preemption_sync_point(step)
  global _sigterm_installed
  if not _sigterm_installed:
    signal.signal(signal.SIGTERM, lambda *_: _sigterm_seen.set())
    _sigterm_installed = True
  return _sigterm_seen.is_set()


def report_failure(key: str, message: str) -> None:
  """Tells the other processes, before a barrier, that this one failed."""
  if is_multiprocess():
    _client().key_value_set(f"{key}/{process_index()}", message[:4000])


def reported_failures(key: str) -> dict[int, str]:
  """After the barrier: {process: message} of those that reported failure."""
  if not is_multiprocess():
    return {}
  out = {}
  for k, v in _client().key_value_dir_get(f"{key}/"):
    try:
      out[int(k.rsplit("/", 1)[-1])] = v
    except ValueError:
      continue
  return out
