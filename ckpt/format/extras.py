"""What a save takes besides the state: its metrics (numbers, kept in the
index for retention and queries) and this process's ``host_state`` (a
msgpack value in the process's own file). Checked on the caller's thread
before anything is written."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import msgpack
import numpy as np

from ckpt.format import index as index_lib
from ckpt.errors import (CheckpointError, CorruptCheckpointError,
                         InvalidStateError)


def check_metrics(metrics: dict | None) -> dict[str, float | int]:
  """``{"a/b": number}``: nested dicts flattened; python, numpy and jax
  scalars; ints (and bools) stay ints, everything else becomes a float."""
  out: dict[str, float | int] = {}

  def walk(prefix: str, node: Any) -> None:
    for k, v in node.items():
      name = f"{prefix}{k}"
      if isinstance(v, dict):
        walk(f"{name}/", v)
        continue
      if name in out:
        raise InvalidStateError(
            f"metric {name!r} is given twice (a nested dict and an 'a/b' "
            "name flatten to the same name)")
      out[name] = _metric_value(name, v)

  if metrics is not None and not isinstance(metrics, dict):
    raise InvalidStateError(
        f"metrics must be a dict of name to number, got {type(metrics).__name__}")
  walk("", metrics or {})
  return out


def _metric_value(name: str, v: Any) -> float | int:
  if isinstance(v, jax.Array):
    if v.shape != ():
      raise InvalidStateError(
          f"metric {name!r} must be a scalar, got a jax.Array of shape "
          f"{v.shape}")
    # A replicated scalar of a multi-process mesh: any local shard holds it.
    v = np.asarray(v.addressable_data(0) if not v.is_fully_addressable else v)
  if isinstance(v, np.ndarray):
    if v.shape != ():
      raise InvalidStateError(
          f"metric {name!r} must be a scalar, got an array of shape {v.shape}")
    v = v[()]
  if isinstance(v, (bool, np.bool_)):
    return int(v)
  if isinstance(v, (int, np.integer)):
    v = int(v)
    if not -2**63 <= v < 2**64:
      raise InvalidStateError(f"metric {name!r}: int {v} does not fit in 64 bits")
    return v
  if isinstance(v, float) or (  # bfloat16 and float8 included
      isinstance(v, np.generic) and jax.numpy.issubdtype(v.dtype,
                                                         jax.numpy.floating)):
    return float(v)
  raise InvalidStateError(
      f"metric {name!r} must be a number (int, float, numpy or jax scalar) "
      f"or a dict of them, got {type(v).__name__} {v!r}")


def pack_host_state(value: Any) -> bytes:
  try:
    data = msgpack.packb(value, use_bin_type=True)
  except Exception as e:
    raise InvalidStateError(
        f"host_state must be msgpack-able (dicts, lists, str, numbers, bytes); "
        f"got {type(value).__name__}: {e}") from e
  if len(data) > index_lib.MAX_PROCESS_FILE_BYTES:
    raise InvalidStateError(
        f"host_state is {len(data)} bytes packed; readers accept at most "
        f"{index_lib.MAX_PROCESS_FILE_BYTES} "
        "(ckpt.format.index.MAX_PROCESS_FILE_BYTES). Save large per-host data as "
        "arrays of the state instead")
  return data


@dataclasses.dataclass(frozen=True)
class EveryProcess:
  """The host_state of every process of another job, given at once:
  ``save(step, state, host_state=EveryProcess(values))`` writes one
  host_state file per value, so that a job of ``len(values)`` processes
  reads back ``values[i]`` on process i (``host_state(step)``), whatever
  the number of processes that saved. ``ckpt import`` gives it for an
  Orbax step's per-process items. In a job of n processes every process
  passes the same values; process p writes those with ``i % n == p``."""
  values: tuple

  def __post_init__(self):
    object.__setattr__(self, "values", tuple(self.values))
    if not 0 < len(self.values) <= index_lib.MAX_PROCESSES:
      raise InvalidStateError(
          f"EveryProcess holds {len(self.values)} values; expected 1 to "
          f"{index_lib.MAX_PROCESSES}")


def host_state_files(host_state: Any, pid: int, n: int
                     ) -> tuple[dict[int, bytes], list]:
  """(this process's host_state files: {process number: msgpack}, its
  claim for the save round). The claim is ``["own", gave]`` for a value of
  this process (``gave``: not None) or ``["every", count]`` for an
  EveryProcess (see ``host_state_count``)."""
  if isinstance(host_state, EveryProcess):
    count = len(host_state.values)
    return ({i: pack_host_state(host_state.values[i])
             for i in range(pid, count, n)}, ["every", count])
  return {pid: pack_host_state(host_state)}, ["own", host_state is not None]


def host_state_count(claims: dict[int, Any], n: int) -> int:
  """The number of host_state files a step holds (the index's
  ``host_states``), from every process's claim: n when a process gave its
  own host_state, 0 when none did (a step without per-process state), the
  count of an EveryProcess (the same on every process). Raises
  InvalidStateError for claims that disagree."""
  kinds = {tuple(c) if isinstance(c, list) else c for c in claims.values()}
  if all(isinstance(k, tuple) and len(k) == 2 and k[0] == "own"
         for k in kinds):
    return n if any(k[1] for k in kinds) else 0
  if (len(kinds) == 1 and (k := next(iter(kinds)))[0] == "every" and
      type(k[1]) is int and k[1] > 0):
    return k[1]
  raise InvalidStateError(
      "host_state: the processes disagree on it (some gave EveryProcess, "
      "of another count or beside their own values): "
      + "; ".join(f"process {p}: {c}" for p, c in sorted(claims.items())[:8]))


def unpack_host_state(data: Any, where: str = "host_state") -> Any:
  """A host_state blob (from an older index, or this process's file), with
  its lengths bounded by its size."""
  if not isinstance(data, bytes):
    raise CheckpointError(f"{where} is {type(data).__name__}, not bytes")
  n = len(data)
  try:
    return msgpack.unpackb(data, raw=False, strict_map_key=False,
                           max_str_len=n, max_bin_len=n, max_array_len=n,
                           max_map_len=n, max_ext_len=n)
  except Exception as e:
    raise CorruptCheckpointError(
        f"{where} is not a valid msgpack value (truncated or corrupt?): {e}"
    ) from e


# The largest custom_metadata of one step, as JSON text. It lives in the
# step's index, which every query and restore reads (process 0, one GET on
# a bucket, ``ckpt inspect``): a few notes and counters, not data (put
# large things in the state, where they are sharded and read lazily).


def check_custom_metadata(value: Any) -> str | None:
  """``save(custom_metadata=...)``: a dict that JSON holds exactly (str
  keys; dicts, lists, str, finite numbers, bool, None), at most
  MAX_CUSTOM_METADATA_BYTES as JSON; returned as that JSON text (None for
  None). Checked on the caller's thread, before anything is written."""
  if value is None:
    return None
  if not isinstance(value, dict):
    raise InvalidStateError(
        "custom_metadata must be a dict (JSON-serialisable), got "
        f"{type(value).__name__}")

  def walk(path: str, node: Any, depth: int) -> None:
    if depth > 64:
      raise InvalidStateError(
          f"custom_metadata{path}: nested more than 64 levels deep")
    if isinstance(node, dict):
      for k, v in node.items():
        if not isinstance(k, str):
          raise InvalidStateError(
              f"custom_metadata{path}: key {k!r} is of type {type(k).__name__}; "
              "expected str keys (JSON would turn it into a string)")
        walk(f"{path}[{k!r}]", v, depth + 1)
    elif isinstance(node, list):
      for i, v in enumerate(node):
        walk(f"{path}[{i}]", v, depth + 1)
    elif isinstance(node, float):
      if node != node or node in (float("inf"), float("-inf")):
        raise InvalidStateError(
            f"custom_metadata{path} is {node!r}; JSON holds finite numbers "
            "only")
    elif not (node is None or isinstance(node, (str, bool, int))):
      raise InvalidStateError(
          f"custom_metadata{path} is a {type(node).__name__} ({node!r:.80}); "
          "expected dict, list, str, int, float, bool or None (convert numpy "
          "and jax scalars with float()/int(), tuples to lists)")

  walk("", value, 0)
  text = json.dumps(value, allow_nan=False, sort_keys=True,
                    separators=(",", ":"))
  if len(text.encode()) > index_lib.MAX_CUSTOM_METADATA_BYTES:
    raise InvalidStateError(
        f"custom_metadata is {len(text.encode())} bytes as JSON; at most "
        f"{index_lib.MAX_CUSTOM_METADATA_BYTES} (ckpt.format.index."
        "MAX_CUSTOM_METADATA_BYTES): it is kept in the step's index, which "
        "every query reads. Save large values as arrays of the state")
  return text
