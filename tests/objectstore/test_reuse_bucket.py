"""reuse_unchanged=True on buckets (S3 and GCS emulators): an unchanged
leaf is held by an earlier step (index version 6, ckpt/save/reuse_held.py)
instead of uploaded again; retention keeps what the kept steps hold
(ckpt/commit/held.py); every kept step restores bit-exact and verifies,
also after the whole root is copied elsewhere, and with 2 real processes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli import main as cli_main
from ckpt.commit import steps as steps_lib
from ckpt.store import storage as storage_lib
from tests.multiprocess import reuse_worker as worker
from tests.multiprocess.launch import launch

MIB = 1 << 20


def _stored_bytes(url: str, step: int) -> int:
  """The bytes of every object in ``step``'s data directory (what its save
  handed to the store), read back from the server."""
  s = storage_lib.Storage(url)
  where = steps_lib.step_dir(s, step)
  return sum(len(s.read_bytes(k)) for k in s.list_keys(f"{where}/"))


def _copy_root(src: str, dst: str) -> None:
  a, b = storage_lib.Storage(src), storage_lib.Storage(dst)
  for k in a.list_all():
    b.write_bytes(k, a.read_bytes(k))


@pytest.mark.parametrize("bucket", ["s3_bucket", "gs_bucket"])
def test_reuse_on_a_bucket_holds_unchanged_leaves(bucket, request):
  url = request.getfixturevalue(bucket) + "/run"
  mesh = Mesh(np.array(jax.devices()).reshape(8), ("x",))
  sh = NamedSharding(mesh, P("x"))
  frozen = np.random.default_rng(0).standard_normal((2048, 1024), np.float32)
  trains = [np.random.default_rng([1, s]).standard_normal((256, 1024),
                                                          np.float32)
            for s in range(4)]
  with ckpt.Checkpointer(url, keep=2, reuse_unchanged=True, async_save=False,
                         chunk_bytes=1 * MIB) as c:
    for step in range(4):
      c.save(step, {"frozen": jax.device_put(frozen, sh),
                    "train": jax.device_put(trains[step], sh)})
      s = c.last_save_stats
      stored = _stored_bytes(url, step)
      if step < 2:  # two copies: steps 0 and 1 write everything
        assert s.bytes_reused == 0 and stored > frozen.nbytes
        continue
      assert s.bytes_reused == frozen.nbytes
      assert s.bytes_written == trains[step].nbytes
      # What the store received for the step: the changing leaf, its
      # index, metadata and per-process files (issue 39's bound).
      assert stored <= 1.5 * trains[step].nbytes + 8 * MIB, stored
    assert c.all_steps() == [2, 3]
  moved = url.rsplit("/", 1)[0] + "/moved"
  _copy_root(url, moved)
  for root in (url, moved):
    for step in (2, 3):
      got = ckpt.load(root, step)
      assert got["frozen"].tobytes() == frozen.tobytes()
      assert got["train"].tobytes() == trains[step].tobytes()
    assert cli_main.main(["verify", root, "--all"]) == 0


def test_two_processes_reuse_across_retention_on_s3(s3_bucket):
  """2 processes x 2 devices, keep=2, steps 0..3: steps 2 and 3 hold the
  frozen leaves (each process its share of their boxes, agreed in one
  round) of steps 0 and 1, which are gone but for what 2 and 3 hold."""
  url = s3_bucket + "/run"
  out = launch("tests.multiprocess.reuse_worker",
               {"scenario": "retention", "dir": url},
               num_processes=2, devices_per_process=2, result=worker.Result)
  worker.check_retention(out)
  s = storage_lib.Storage(url)
  assert s.list_keys("checkpoint_0/")  # hold the frozen leaves
  assert s.list_keys("checkpoint_1/")
  for step in (2, 3):
    got, want = ckpt.load(url, step), worker.state(step)
    for k in worker.LEAVES:
      assert got[k].tobytes() == want[k].tobytes(), (step, k)
  assert cli_main.main(["verify", url, "--all"]) == 0


def test_a_restarted_job_reuses_its_steps_on_s3(s3_bucket):
  """Issue 45, item 5, with 2 real processes on S3: the restarted job's
  first save holds the frozen leaves (each process checks the generations
  of its chunk objects) and uploads only the changing one."""
  url = s3_bucket + "/run"
  worker.check_resumed(url, launch)
  assert _check_bucket(url) == [2, 3]


def test_a_chunk_only_process_1_holds_overwritten_on_s3(s3_bucket):
  """2 processes: the holder object of a frozen chunk that only process 1
  stores is overwritten between two jobs; the restarted job's save finds
  it on process 1 alone, both processes agree to write that leaf (never
  held from the damaged holder), and the step restores exactly."""
  from ckpt.restore import read as read_lib  # pylint: disable=g-import-not-at-top
  url = s3_bucket + "/run"
  launch("tests.multiprocess.reuse_worker",
         {"scenario": "resume", "dir": url, "steps": [0, 1, 2]},
         num_processes=2, devices_per_process=2, result=worker.Result)
  s = storage_lib.Storage(url)

  def frozen_of(step):
    where = steps_lib.step_dir(s, step)
    e = next(e for e in read_lib.read_index(s, where).leaves
             if e.relpath == "frozen")
    return e.held_by or (step, where.split("/")[1])

  holder = frozen_of(1)  # what the save of step 3 would hold
  keys = [k for k in s.list_keys(f"checkpoint_{holder[0]}/{holder[1]}/frozen/")
          if k.rsplit("/", 1)[1][0].isdigit()]
  key = max(keys, key=lambda k: tuple(map(int, k.rsplit("/", 1)[1].split("."))))
  data = bytearray(s.read_bytes(key))  # the last rows: process 1's
  data[5] ^= 1
  s.write_bytes(key, bytes(data))
  out = launch("tests.multiprocess.reuse_worker",
               {"scenario": "resume", "dir": url, "steps": [3]},
               num_processes=2, devices_per_process=2, result=worker.Result)
  assert all(r.exact for r in out), out
  assert frozen_of(3) == (3, steps_lib.step_dir(s, 3).split("/")[1])
  assert sum(r.stats[0].reused for r in out) == (
      worker.frozen_bytes() - int(np.prod(worker.LEAVES["frozen"][0])) * 4)
  assert _check_bucket(url) == [2, 3]


def _check_bucket(url: str) -> list[int]:
  """Every committed step restores bit-exact and verifies; returns them."""
  steps = steps_lib.committed_steps(storage_lib.Storage(url))
  for s in steps:
    got, want = ckpt.load(url, s), worker.state(s)
    for k in worker.LEAVES:
      assert got[k].tobytes() == want[k].tobytes(), f"step {s} leaf {k}"
  if steps:
    assert cli_main.main(["verify", url, "--all"]) == 0
  return steps


def test_sigkill_during_saves_and_retention_on_s3(s3_bucket, tmp_path):
  """2 processes save back to back (keep=3: every save's retention deletes
  a step that the kept ones may hold leaves of) and are SIGKILLed at
  random moments; after each kill every committed step restores bit-exact
  and verifies; a last run resumes and holds again."""
  import random  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  from ckpt.multihost import local_cluster  # pylint: disable=g-import-not-at-top
  from tests.multiprocess.launch import REPO  # pylint: disable=g-import-not-at-top
  from tests.multiprocess.test_reuse_mp import _wait_saved  # pylint: disable=g-import-not-at-top
  rng = random.Random(20261127)
  url, events = s3_bucket + "/run", tmp_path / "events"
  events.mkdir()
  conf = {"scenario": "killloop", "dir": url, "events": str(events),
          "max_step": 10**6}
  latest = None
  for launch_no in range(3):
    cluster = local_cluster.start("tests.multiprocess.reuse_worker",
                                  dict(conf, launch=launch_no),
                                  num_processes=2, devices_per_process=2,
                                  cwd=str(REPO))
    try:
      _wait_saved(cluster, events, launch_no)
      time.sleep(rng.uniform(0.5, 3.0))  # a few saves and retentions in
      for v in rng.choice([[0], [1], [0, 1]]):
        cluster.kill(v, signal.SIGKILL)
    finally:
      cluster.wait(0, grace_s=0)
    steps = _check_bucket(url)
    assert steps and (latest is None or steps[-1] >= latest), (latest, steps)
    latest = steps[-1]
    print(f"kill {launch_no}: committed steps {steps}")
  final = latest + 4
  known = min(2, len(steps))
  out = launch("tests.multiprocess.reuse_worker",
               dict(conf, launch=3, max_step=final), num_processes=2,
               devices_per_process=2, result=worker.Result)
  assert _check_bucket(url) == list(range(final - 3, final))
  for i in range(len(out[0].stats)):  # from the records of the newest
    reused = sum(r.stats[i].reused for r in out)  # two steps
    assert reused == (worker.frozen_bytes() if i + known >= 2 else 0), (
        i, known)
