"""Process identity, barriers and small broadcasts: the only multi-host module.

Everything goes through the ``jax.distributed`` client, so it works the same
on a TPU pod and on N local CPU processes started with
``jax.distributed.initialize(coordinator_address="127.0.0.1:<port>", ...)``.
These calls block, use no device collectives, and are safe to call from the
Checkpointer's background thread.

Every call into the coordination service is bounded here, whatever the
client does: the service runs inside process 0, and a process 0 that is
stopped (SIGSTOP, a debugger), swapped out or hung in native code leaves
the others' calls unanswered. Measured with jaxlib 0.10.2: a
``key_value_set``, a ``key_value_try_get`` and a ``wait_at_barrier`` whose
own timeout was 5 s all waited until JAX's heartbeat aborted the process
(SIGABRT after about 100 s, no ckpt error); only ``blocking_key_value_get``
gave up at its timeout. So each call runs on a daemon thread of its own
and the caller waits for it with a bound (``_Client``):

- a call with a timeout of its own (``wait_at_barrier``, the blocking
  gets) is given up ``GRACE_S`` after it, and while it waits the service is
  asked a trivial question every ``answer_s`` (a ``key_value_try_get``):
  one left unanswered for ``answer_s`` ends the wait at once;
- any other call (set, get, dir get, delete) is given up after
  ``answer_s`` = min(``ANSWER_S``, the timeout of the collective call it
  belongs to, ``barrier_timeout_s``): these take milliseconds.

A call given up so raises ``BarrierTimeoutError`` naming process 0 (whose
coordination service did not answer), what was asked and for how long;
while that call is still unanswered, every later call of this process
raises the same at once (its thread waits on and clears that when the
service answers). So with process 0 frozen, the others raise within
``barrier_timeout_s`` + ``GRACE_S``, and within ``2 * ANSWER_S`` whatever
``barrier_timeout_s`` is: before JAX's heartbeat (100 s by default)
aborts them.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import secrets
import signal
import threading
from typing import Callable

import jax
from jax._src import distributed as _distributed

from ckpt.errors import BarrierTimeoutError, CheckpointError
from ckpt.multihost import coordination

DEFAULT_TIMEOUT_S = 600.0
# Why a process waits that long (said where the wait ends): a peer may be
# arriving late for a good reason, which ckpt cannot tell from a call that
# some process never makes.
WAIT_WHY = ("(barrier_timeout_s, 600 s by default, is how long a process "
            "waits for the others: long enough for a peer still busy with "
            "its previous work, such as a compile, an evaluation or a "
            "synchronous save of a large state; a Checkpointer with a "
            "smaller barrier_timeout_s reports a call missing on some "
            "process sooner.)")
ANSWER_S, GRACE_S = coordination.ANSWER_S, coordination.GRACE_S
_calls: collections.Counter[str] = collections.Counter()
_calls_lock = threading.Lock()


def process_index() -> int:
  return jax.process_index()


def process_count() -> int:
  return jax.process_count()


def coordination_client(timeout_s: float = DEFAULT_TIMEOUT_S):
  """The distributed client, each call timed and bounded (module
  docstring); ``timeout_s``: the timeout of the collective call it serves."""
  client = _distributed.global_state.client
  return None if client is None else coordination.BoundedClient(
      client, timeout_s)


def is_multiprocess() -> bool:
  return process_count() > 1 and coordination_client() is not None


def call_key(*parts) -> str:
  """The key prefix of one collective call, the same on every process.

  It is built from what every process knows (the directory, the operation,
  the step) and from how many times this process made that same call
  before. A call that fails on one process still counts there (the count
  advances before anything can fail), so a failure never shifts the keys of
  later calls; and because the step is part of the key, a process that
  skipped a save of one step does not shift the keys of other steps.
  """
  base = "/".join(str(p) for p in parts)
  with _calls_lock:
    n = _calls[base]
    _calls[base] += 1
  return f"ckpt/{base}/{n}"


def agree(key: str, post: str | None,
          decide: Callable[[dict[int, str]], str], *,
          timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "") -> str:
  """One round: every process posts ``post``; process 0 decides; all return
  the decision.

  ``decide({process: post})`` runs on process 0 only and must not raise (an
  error is a decision like any other). Costs per process: one set, one
  barrier, one get; process 0 reads all posts in one request. A process
  that does not arrive makes the barrier time out, naming it. ``post``
  None: this process arrives without posting (no set; ``decide`` does not
  see it: a caller whose process 0 knows what it would have posted,
  ``agreement.save_round``).
  """
  if not is_multiprocess():
    return decide({} if post is None else {0: post})
  client, pid = coordination_client(timeout_s), process_index()
  if post is not None:
    with _naming(what or key):
      client.key_value_set(f"{key}/in/{pid}", post)
  barrier(f"{key}/in", timeout_s=timeout_s, what=what)
  if pid == 0:
    with _naming(what or key):
      decision = decide(_by_process(client.key_value_dir_get(f"{key}/in/")))
      client.key_value_set(f"{key}/out", decision)
    return decision
  return wait_for_key(client.blocking_key_value_get, f"{key}/out", timeout_s,
                       f"the decision on {what or key} from process 0")


@contextlib.contextmanager
def _naming(what: str):
  """A call the coordination service did not answer names ``what`` it was
  part of."""
  try:
    yield
  except BarrierTimeoutError as e:
    if getattr(e, "late", None) is None or what in str(e):
      raise
    named = BarrierTimeoutError(f"{what}: {e}")
    named.late = e.late
    raise named from e


def all_ok(key: str, error: BaseException | None, what: str,
           timeout_s: float, same: str = "", differ: str = "",
           tally: int | None = None) -> dict[int, int]:
  """One round before a collective: every process says whether it got
  here without failing; if any did, all raise (the failing process its own
  error), instead of the others waiting forever in an all-gather that
  process never joins.

  ``same``: what this process is about to do (the leaf it exchanges, say).
  If the processes that did not fail say different things, all raise a
  CheckpointError naming what each said, followed by ``differ`` (why it
  must be the same): a collective over different data would mix it.

  ``tally``: a count this process posts with its outcome (bytes it
  fetched, say); returns {process: its tally} of the processes that posted
  one (empty if none did)."""
  def decide(posts: dict[int, str]) -> str:
    got = {p: json.loads(v) for p, v in sorted(posts.items())}
    failed = {p: g[0] for p, g in got.items() if g[0]}
    if failed:
      return json.dumps({"failed": failed})
    if len({g[1] for g in got.values()}) > 1:
      return json.dumps({"differ": {p: g[1] for p, g in got.items()}})
    tallies = {p: g[2] for p, g in got.items()
               if len(g) > 2 and g[2] is not None}
    return json.dumps({"tally": tallies} if tallies else {})

  err = "" if error is None else f"{type(error).__name__}: {error}"[:2000]
  out = json.loads(agree(key, json.dumps(
      [err, same[:2000], None if tally is None else int(tally)]), decide,
      timeout_s=timeout_s, what=what))
  if error is not None:
    raise error
  if "failed" in out:
    failures = out["failed"]
    relay = CheckpointError(
        f"{what} failed on process(es) {sorted(int(p) for p in failures)}: "
        + "; ".join(f"process {p}: {m}" for p, m in failures.items()))
    relay.relayed_from = sorted(int(p) for p in failures)
    raise relay
  if "differ" in out:
    said = out["differ"]
    first = said.get("0", next(iter(said.values())))
    others = "; ".join(f"process {p}: {m}" for p, m in said.items()
                       if m != first)
    raise CheckpointError(
        f"{what}: the processes are not doing the same thing: process 0: "
        f"{first}; {others}. {differ}".rstrip())
  return {int(p): int(n) for p, n in out.get("tally", {}).items()}


def forget(key: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
  """Process 0 deletes every key under ``key`` once no process needs them,
  so the coordination service does not grow with every save."""
  if is_multiprocess() and process_index() == 0:
    try:
      coordination_client(timeout_s).key_value_delete(f"{key}/")
    except Exception as e:  # pylint: disable=broad-except
      from absl import logging  # pylint: disable=g-import-not-at-top
      logging.warning("ckpt: could not delete coordination keys %s/: %s", key, e)


def barrier(name: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
            what: str = "") -> None:
  """Blocks until every process calls barrier(name); names must be unique."""
  if not is_multiprocess():
    return
  try:
    coordination_client(timeout_s).wait_at_barrier(name, int(timeout_s * 1000))
  except Exception as e:  # jaxlib raises its own XlaRuntimeError type
    if getattr(e, "late", None) is not None:  # a silent service
      silent = BarrierTimeoutError(f"barrier {name!r} ({what or 'ckpt'}): {e}")
      silent.late = e.late
      raise silent from e
    late = _late_processes(str(e))
    raise BarrierTimeoutError(
        f"barrier {name!r} ({what or 'ckpt'}) failed after {timeout_s:.0f}s "
        f"on process {process_index()} of {process_count()}; processes that "
        f"did not arrive: {late or 'unknown'}. Check that every process "
        f"called the same save/restore with the same step, and look at the "
        f"logs of the late processes. {WAIT_WHY} Cause: {e}") from e


def _late_processes(message: str) -> list[int]:
  m = re.search(r"timed out task names:\s*([\s\S]*?)(?:\n\n|$)", message)
  if not m:
    return []
  return sorted({int(x) for x in re.findall(r"(?:task[:_ ]?)?(\d+)", m.group(1))})


def wait_for_key(get, key: str, timeout_s: float, what: str):
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
  client = coordination_client(timeout_s)
  if process_index() == 0:
    value = make_value()
    client.key_value_set(key, value)
    return value
  return wait_for_key(client.blocking_key_value_get, key, timeout_s,
                       f"{what or 'a value'} from process 0")


def announce_value(key: str, value: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                   what: str = "") -> None:
  """Process 0 sets ``key`` to ``value``, for ``wait_for_value``."""
  if is_multiprocess():
    with _naming(what or key):
      coordination_client(timeout_s).key_value_set(key, value)


def wait_for_value(key: str, timeout_s: float, what: str) -> str:
  """``announce_value``'s value, waiting for it at most ``timeout_s``
  (BarrierTimeoutError naming ``what``)."""
  return wait_for_key(coordination_client(timeout_s).blocking_key_value_get,
                      key, timeout_s, what)


def announce(key: str, previous: str | None = None) -> None:
  """Process 0 sets ``key`` (a fact the others may wait for: ``await_announced``),
  and deletes ``previous`` (a signal nobody waits for any more)."""
  if not is_multiprocess() or process_index() != 0:
    return
  client = coordination_client()
  client.key_value_set(key, "1")
  if previous is not None:
    try:
      client.key_value_delete(previous)
    except Exception:  # pylint: disable=broad-except
      pass  # one small key left behind


def await_announced(key: str, timeout_s: float) -> bool:
  """Waits at most ``timeout_s`` for process 0's ``announce(key)``; False if
  it did not come (the caller goes on without it)."""
  if not is_multiprocess():
    return True
  try:
    client = coordination_client()
    client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
    return True
  except Exception:  # pylint: disable=broad-except
    return False


def unique_token() -> str:
  return secrets.token_hex(6)


def post_bytes(key: str, data: bytes,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
  """This process's ``data`` under ``key``, for ``read_post``."""
  if is_multiprocess():
    client = coordination_client(timeout_s)
    client.key_value_set_bytes(f"{key}/{process_index()}", data)


def read_post(key: str, process: int, timeout_s: float = DEFAULT_TIMEOUT_S,
              what: str = "data") -> bytes:
  """What ``process`` posted under ``key`` with ``post_bytes``, waiting for
  it at most ``timeout_s`` (BarrierTimeoutError naming ``what``)."""
  get = coordination_client(timeout_s).blocking_key_value_get_bytes
  return wait_for_key(get, f"{key}/{process}", timeout_s, what)


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
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
      _sigterm_seen.set()
      if callable(previous):  # chain to the handler this one replaces
        previous(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
    _sigterm_installed = True
  return _sigterm_seen.is_set()


def report_failure(key: str, message: str,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
  """Tells the other processes, before a barrier, that this one failed."""
  if is_multiprocess():
    client = coordination_client(timeout_s)
    client.key_value_set(f"{key}/{process_index()}", message[:4000])


def reported_failures(key: str, timeout_s: float = DEFAULT_TIMEOUT_S
                      ) -> dict[int, str]:
  """After the barrier: {process: message} of those that reported failure."""
  if not is_multiprocess():
    return {}
  client = coordination_client(timeout_s)
  return _by_process(client.key_value_dir_get(f"{key}/"))


def _by_process(items) -> dict:
  """``[("<key>/<process>", value), ...]`` -> ``{process: value}``."""
  out = {}
  for k, v in items:
    try:
      out[int(k.rsplit("/", 1)[-1])] = v
    except ValueError:
      continue
  return out
