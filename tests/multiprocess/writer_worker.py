"""One process of the multi-process writer="process" tests (issue 50).

Run by ``test_writer_mp.py`` through ``ckpt.multihost.local_cluster`` as
``python -m tests.multiprocess.writer_worker <json config>``. The global
arrays come from fixed seeds (``truth``), so any process, or the test,
checks what was saved bit for bit.

Scenarios (``config["scenario"]``):

- ``roundtrip``: saves steps 1 and 2 with ``writer="process"`` (in
  ``config["format"]``, default "zarr"; with small leaves, which are
  packed, when ``config["small"]``; format "ocdbt" in merge groups with
  ``config["keys_per_merge"]``), waits, restores step 2 onto the same
  shardings and onto another mesh (the devices reversed, the large leaf
  split along its other axis) and checks every addressable shard; no
  shared memory of this process is left.
- ``hold``: saves ``config["step"]`` asynchronously (in
  ``config["format"]``, default "zarr"); once ``save()``
  returned, stops its writer (SIGSTOP: the test lets it go on), writes
  ``<events>/p<process>.json`` (its writer's pid), and waits to be killed.
  ``config["before"]`` (optional): a step saved and committed first (by
  the thread: the writer process starts at the held save, as at a job's
  first save).
  ``lease_s``, ``keep`` (optional): the Checkpointer's.
- ``reuse``: ``reuse_unchanged=True``: saves steps 0..2, then step 3 with
  a new Checkpointer (a new writer), a frozen leaf beside a changing one;
  the bytes each save reused, and whether each step restored bit-exact.
- ``after``: a restarted job: its first save (``config["step"]``) commits;
  the newest step before it and the steps after it are returned
  (``config["keep"]``: its retention).
- ``crash``: saves ``config["before"]`` (the thread), then
  ``config["step"]`` with its writer process killed at a point
  (``config["kill"]``, tests/multiprocess/writer_faults.py: ``before
  rename`` of process 0's writer, ``before record`` and ``after record``
  of process 1's), or its trainer (``mid hand-over``: process 1 SIGKILLs
  itself as it stages its second box); returns what that save raised and
  the ckpt warnings it logged, then saves ``config["again"]`` and returns
  the steps and the writer pids of both saves.
- ``restart``: a job restarted at once while the dead job's writers still
  hold their save (``config["writer"]``: this job's writer): the newest
  step, restored and checked, then its save of ``config["step"]`` (the
  state of ``config["mib"]``: told apart from the dead job's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import zlib

import numpy as np

from tests.multiprocess import worker

ROWS_PER_MIB = 256  # rows of 1024 float32


def truth(name: str, mib: int) -> np.ndarray:
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  return rng.standard_normal((mib * ROWS_PER_MIB, 1024), dtype=np.float32)


def names(mib: int) -> dict[str, int]:
  """Leaf name -> its MiB (one large, one small)."""
  return {"big": mib, "small": 1}


def state(mib: int):
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  out = {}
  for name, m in names(mib).items():
    full = truth(name, m)
    sharding = NamedSharding(mesh, P("data"))
    out[name] = jax.make_array_from_callback(full.shape, sharding,
                                             lambda idx, f=full: f[idx])
  out["step"] = 3
  return out


def segments() -> list[str]:
  return [n for n in os.listdir("/dev/shm")
          if n.startswith(f"ckpt-{os.getpid()}-")]


def writer_pids() -> list[int]:
  import psutil  # pylint: disable=import-outside-toplevel
  return [p.pid for p in psutil.Process().children()
          if "ckpt.save.writer_main" in " ".join(p.cmdline())
          or "writer_faults" in " ".join(p.cmdline())]


def small_state() -> dict:
  """Small leaves (each packed), split over every device: every process
  writes boxes of them into its packs."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  return {f"s{i}": jax.make_array_from_callback(
      full.shape, NamedSharding(mesh, P("data")), lambda idx, f=full: f[idx])
          for i in range(6)
          for full in [small_truth(i)]}


def small_truth(i: int) -> np.ndarray:
  return np.random.default_rng(1000 + i).standard_normal(
      (8 * (i + 1), 16), dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class Roundtrip:
  process: int
  steps: list[int]
  exact: bool
  writers: int
  segments: list[str]
  remeshed: bool


def roundtrip(conf: dict) -> Roundtrip:
  import jax  # pylint: disable=import-outside-toplevel
  import ckpt  # pylint: disable=import-outside-toplevel
  if conf.get("keys_per_merge"):  # a tiny one stands in for a large step
    from ckpt.store import ocdbt  # pylint: disable=import-outside-toplevel
    ocdbt.KEYS_PER_MERGE = conf["keys_per_merge"]
  s = state(conf["mib"])
  if conf.get("small"):
    s.update(small_state())
  with ckpt.Checkpointer(conf["dir"], writer="process",
                         format=conf.get("format", "zarr"),
                         barrier_timeout_s=60) as ckptr:
    for step in (1, 2):
      ckptr.save(step, s)
      ckptr.wait_until_finished()
    n_writers = len(writer_pids())
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.Array) else x, s)
    got = ckptr.restore(2, target=target)
    exact = all(
        np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()
        for name in s if name != "step"
        for a, b in zip(got[name].addressable_shards,
                        s[name].addressable_shards))
    remeshed = _remeshed(ckptr, conf["mib"])
    steps = ckptr.all_steps()
  return Roundtrip(jax.process_index(), steps, exact, n_writers, segments(),
                   remeshed)


def _remeshed(ckptr, mib: int) -> bool:
  """Step 2 restored onto another mesh (the devices reversed, the large
  leaves split along their other axis, over the other mesh axis)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  devices = np.asarray(jax.devices()[::-1]).reshape(2, -1)
  mesh = jax.sharding.Mesh(devices, ("a", "b"))
  sharding = NamedSharding(mesh, P("a", "b"))
  target = {name: jax.ShapeDtypeStruct((m * ROWS_PER_MIB, 1024), np.float32,
                                       sharding=sharding)
            for name, m in names(mib).items()}
  got = ckptr.restore(2, target=target)  # a subset of the saved tree
  return all(
      got[name].sharding == sharding and
      np.asarray(shard.data).tobytes() == truth(name, m)[shard.index].tobytes()
      for name, m in names(mib).items()
      for shard in got[name].addressable_shards)


def hold(conf: dict) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import ckpt  # pylint: disable=import-outside-toplevel
  s = state(conf["mib"])
  options = dict(barrier_timeout_s=conf["bound_s"],
                 lease_s=conf.get("lease_s", 30.0), keep=conf.get("keep"),
                 format=conf.get("format", "zarr"))
  if conf.get("before") is not None:  # (the writer starts at step's save)
    with ckpt.Checkpointer(conf["dir"], **options) as first:
      first.save(conf["before"], s)
  ckptr = ckpt.Checkpointer(conf["dir"], writer="process",
                            concurrent_bytes=(conf["mib"] + 16) << 20,
                            **options)
  t0 = time.monotonic()
  ckptr.save(conf["step"], s)
  save_s = time.monotonic() - t0
  pids = writer_pids()
  for pid in pids:
    os.kill(pid, signal.SIGSTOP)
  path = os.path.join(conf["events"], f"p{jax.process_index()}.json")
  with open(path + ".tmp", "w") as f:
    json.dump({"writers": pids, "save_s": save_s, "trainer": os.getpid()}, f)
  os.rename(path + ".tmp", path)
  time.sleep(600)
  return {"process": jax.process_index()}


@dataclasses.dataclass(frozen=True)
class Reused:
  process: int
  reused: list[int]  # bytes_reused of each save (steps 0..3)
  exact: bool


def reuse(conf: dict) -> Reused:
  """reuse_unchanged=True: steps 0..2 by one Checkpointer, step 3 by a new
  one (a new writer, from the records); a frozen leaf and a changing one."""
  import jax  # pylint: disable=import-outside-toplevel
  import ckpt  # pylint: disable=import-outside-toplevel

  def at(step: int) -> dict:
    out = state(1)  # "big" and "small": 1 MiB each, frozen
    out["train"] = out.pop("small")
    out["train"] = jax.numpy.asarray(out["train"]) + step
    return out

  reused, exact = [], True
  for steps in ((0, 1, 2), (3,)):
    with ckpt.Checkpointer(conf["dir"], writer="process",
                           reuse_unchanged=True, chunk_bytes=64 << 10,
                           barrier_timeout_s=60) as ckptr:
      for step in steps:
        ckptr.save(step, at(step))
        ckptr.wait_until_finished()
        reused.append(ckptr.last_save_stats.bytes_reused)
        got = ckptr.restore(step, target=jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                           sharding=x.sharding)
            if isinstance(x, jax.Array) else x, at(step)))
        want = at(step)
        exact &= all(
            np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()
            for name in ("big", "train")
            for a, b in zip(got[name].addressable_shards,
                            want[name].addressable_shards))
  return Reused(jax.process_index(), reused, exact)


@dataclasses.dataclass(frozen=True)
class After:
  process: int
  latest: int | None  # before its save
  steps: list[int]


def after(conf: dict) -> After:
  import jax  # pylint: disable=import-outside-toplevel
  import ckpt  # pylint: disable=import-outside-toplevel
  with ckpt.Checkpointer(conf["dir"], writer="process",
                         format=conf.get("format", "zarr"),
                         barrier_timeout_s=60,
                         keep=conf.get("keep")) as ckptr:
    latest = ckptr.latest_step()
    ckptr.save(conf["step"], state(1))
    ckptr.wait_until_finished()
    return After(jax.process_index(), latest, ckptr.all_steps())


@dataclasses.dataclass(frozen=True)
class Crash:
  process: int
  error: str | None  # what the save with the kill raised
  steps: list[int]  # after the next save
  warnings: list[str]  # ckpt's warnings during the save with the kill
  writers: list[list[int]]  # the writer pids after each of the two saves


def crash(conf: dict) -> Crash:
  import jax  # pylint: disable=import-outside-toplevel
  import ckpt  # pylint: disable=import-outside-toplevel
  from ckpt.save import staging  # pylint: disable=import-outside-toplevel
  from ckpt.save import writer_client  # pylint: disable=import-outside-toplevel
  from tests.multiprocess import writer_faults  # pylint: disable=import-outside-toplevel
  import logging as std_logging  # pylint: disable=import-outside-toplevel
  me, kill = jax.process_index(), conf["kill"]
  s = state(conf["mib"])
  options = dict(barrier_timeout_s=conf["bound_s"])
  with ckpt.Checkpointer(conf["dir"], **options) as first:
    first.save(conf["before"], s)
  victim = 0 if kill == "before rename" else 1
  if me == victim and kill == "mid hand-over":
    plain, staged = staging.host_box, []

    def stage_then_die(*args):
      staged.append(1)
      if len(staged) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
      return plain(*args)

    staging.host_box = stage_then_die
  elif me == victim:
    writer_client.WRITER_MODULE = "tests.multiprocess.writer_faults"
    os.environ[writer_faults.KILL_AT] = kill
  ckptr = ckpt.Checkpointer(conf["dir"], writer="process",
                            concurrent_bytes=1 << 20, **options)
  error = None
  warned: list[str] = []

  class Keep(std_logging.Handler):
    def emit(self, record):
      if record.levelno >= std_logging.WARNING:
        warned.append(record.getMessage())

  keep = Keep()
  std_logging.getLogger("absl").addHandler(keep)
  try:
    ckptr.save(conf["step"], s)
    ckptr.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    error = f"{type(e).__name__}: {e}"
  std_logging.getLogger("absl").removeHandler(keep)
  writers = [writer_pids()]
  writer_client.WRITER_MODULE = "ckpt.save.writer_main"
  os.environ.pop(writer_faults.KILL_AT, None)
  ckptr.save(conf["again"], s)
  ckptr.wait_until_finished()
  writers.append(writer_pids())
  steps = ckptr.all_steps()
  ckptr.close()
  return Crash(me, error, steps, warned, writers)


@dataclasses.dataclass(frozen=True)
class Restart:
  process: int
  latest: int | None
  exact: bool
  steps: list[int]


def restart(conf: dict) -> Restart:
  import jax  # pylint: disable=import-outside-toplevel
  import ckpt  # pylint: disable=import-outside-toplevel
  with ckpt.Checkpointer(conf["dir"], writer=conf["writer"],
                         barrier_timeout_s=60, lease_s=conf["lease_s"],
                         keep=conf.get("keep")) as ckptr:
    latest = ckptr.latest_step()
    exact = False
    if latest is not None:
      got = ckptr.restore(latest)
      exact = all(np.asarray(got[name]).tobytes() ==
                  truth(name, m).tobytes()
                  for name, m in names(conf["old_mib"]).items())
    ckptr.save(conf["step"], state(conf["mib"]))
    ckptr.wait_until_finished()
    return Restart(jax.process_index(), latest, exact, ckptr.all_steps())


if __name__ == "__main__":
  worker.main({"roundtrip": roundtrip, "hold": hold, "after": after,
               "reuse": reuse, "restart": restart, "crash": crash})
