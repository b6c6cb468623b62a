"""What the workers of tests/multiprocess share, and the typed results their
tests read.

A worker is ``python -m tests.multiprocess.<name>_worker <json config>``,
started by ``ckpt.multihost.local_cluster``; it ends with
``worker.main(SCENARIOS)`` (``config["scenario"]`` picks one) or
``worker.main(run)``: the process joins the job, runs, and writes what it
returns as JSON. A scenario returns a dataclass of named fields (or a plain
dict, for the workers not converted yet); each call whose failure the test
checks is an ``Outcome`` (``timed(fn)``): what it raised, how long it took,
what it returned.

The test decodes each process's JSON back into that dataclass
(``decode(OneFails, r)``, or ``launch.launch(..., result=OneFails)``), so
it reads ``r.s2.error.msg`` instead of ``r["s2"][0]["msg"]``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import types
import typing
from typing import Any, Callable, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Error:
  """An exception a worker caught: its class name and its message."""
  type: str
  msg: str

  @classmethod
  def of(cls, e: BaseException | None) -> "Error | None":
    return None if e is None else cls(type(e).__name__, str(e))


@dataclasses.dataclass(frozen=True)
class Outcome:
  """One call in a worker: what it raised (None if it returned), how many
  seconds it took, and what it returned (None if it raised)."""
  error: Error | None
  seconds: float
  value: Any = None

  @property
  def ok(self) -> bool:
    return self.error is None


def timed(fn: Callable[..., Any], *args, **kwargs) -> Outcome:
  """Calls ``fn(*args, **kwargs)``; its Outcome (an Exception is caught)."""
  t0 = time.monotonic()
  try:
    value = fn(*args, **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    return Outcome(Error.of(e), time.monotonic() - t0)
  return Outcome(None, time.monotonic() - t0, value)


def touch(path: str) -> None:
  """Creates ``path`` at once (written aside, then renamed): a mark another
  process polls for."""
  with open(path + ".partial", "w") as f:
    f.write(str(time.time()))
  os.replace(path + ".partial", path)


def wait_for(path: str, timeout_s: float) -> bool:
  """Whether ``path`` appeared within ``timeout_s`` (polled)."""
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.01)
  return True


def encode(value: Any) -> Any:
  """``value`` as JSON-ready data: dataclasses as dicts of their fields."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: encode(getattr(value, f.name))
            for f in dataclasses.fields(value)}
  if isinstance(value, dict):
    return {k: encode(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [encode(v) for v in value]
  return value


def decode(cls: type[T], data: Any) -> T:
  """``data`` (what ``encode`` made of a ``cls``) as a ``cls`` again; fields
  typed as dataclasses, ``X | None``, ``list[X]`` and ``dict[str, X]`` are
  decoded in turn. A missing or extra field raises TypeError."""
  return _decode(cls, data)


def _decode(tp: Any, data: Any) -> Any:
  if data is None or tp is Any:
    return data
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
    return _decode(inner, data)
  if origin is list:
    (inner,) = typing.get_args(tp)
    return [_decode(inner, v) for v in data]
  if origin is dict:
    _, inner = typing.get_args(tp)
    return {k: _decode(inner, v) for k, v in data.items()}
  if dataclasses.is_dataclass(tp):
    hints = typing.get_type_hints(tp)
    return tp(**{k: _decode(hints[k], v) for k, v in data.items()})
  return data


def main(run: Callable[[dict], Any] | dict[str, Callable[[dict], Any]]
         ) -> None:
  """A worker's entry point: joins the job, then runs ``run(config)`` (or
  ``run[config["scenario"]](config)``) and writes its encoded result."""
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  conf = json.loads(sys.argv[1])
  local_cluster.init_from_env()
  fn = run[conf["scenario"]] if isinstance(run, dict) else run
  local_cluster.write_result(encode(fn(conf)))
