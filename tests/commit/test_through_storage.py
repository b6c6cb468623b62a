"""The commit through the storage (ckpt/commit/through_storage.py), on a
local disk: writer processes with no coordination service alive.

The writers are plain processes (tests/commit/through_storage_worker.py:
never ``jax.distributed``); each writes its share of a step saved by a
Checkpointer beforehand (tests/commit/writers.py) into an attempt prepared
as a trainer prepares one, then its record; process 0's writer commits.
The step then restores bit for bit through the normal Checkpointer, or
(a writer killed, a stale or damaged record) nothing is committed, nothing
partial is visible, and the next save cleans the attempt up.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import msgpack
import pytest

from ckpt.commit import cleanup as cleanup_lib
from ckpt.commit import protocol as commit_lib
from ckpt.commit import steps as steps_lib
from ckpt.commit import through_storage
from ckpt.errors import BarrierTimeoutError, CheckpointError
from ckpt.format import index as index_lib
from ckpt.format import seal
from ckpt.shards import tiling
from ckpt.store import storage as storage_lib
from tests.commit import writers


@pytest.fixture
def source(tmp_path, rng):
  st = writers.state(rng)
  return st, writers.saved(tmp_path, st)


def _committed(url: str) -> list[int]:
  return steps_lib.committed_steps(storage_lib.Storage(url))


def _attempts(ckpt_dir) -> list[str]:
  return sorted(p.name for p in ckpt_dir.iterdir() if ".tmp-" in p.name)


@pytest.mark.parametrize("processes", [2, 4])
def test_every_record_in_commits_and_restores_bit_exact(
    tmp_path, ckpt_dir, source, make_ckptr, processes):
  st, src = source
  job = writers.Job(os.fspath(ckpt_dir), src, processes)
  assert all(job.share(p)[0] for p in range(processes))  # arrays each
  job.prepare()
  procs = [job.start(tmp_path, p) for p in reversed(range(processes))]
  outs = [writers.outcome(p) for p in procs]
  assert all(o["committed"] for o in outs), outs
  assert _committed(job.url) == [job.step]
  assert _attempts(ckpt_dir) == []
  writers.assert_same(make_ckptr().restore(job.step), st)
  # Process 0's writer held the lease (it names that process, not the
  # trainer that prepared the attempt: here the test).
  lease = json.loads((ckpt_dir / f"checkpoint_{job.step}" / "attempt.json"
                      ).read_bytes())
  assert lease["pid"] == next(o["pid"] for o in outs if o["process"] == 0)
  # Each writer's record is part of the step, named by process.
  assert sorted(os.listdir(ckpt_dir / f"checkpoint_{job.step}" / ".writers")
                ) == [f"{p}.msgpack" for p in range(processes)]


def test_a_writer_killed_before_its_record_commits_nothing(
    tmp_path, ckpt_dir, source, make_ckptr, rng):
  st, src = source
  ckptr = make_ckptr(async_save=False)
  earlier = writers.state(rng, 1)
  assert ckptr.save(5, earlier)
  job = writers.Job(os.fspath(ckpt_dir), src, 2, bound_s=3.0)
  rel = job.prepare()
  victim = job.start(tmp_path, 1, hold=True)
  writers.expect_line(victim, "ready")  # its data written, no record
  victim.send_signal(signal.SIGKILL)
  assert victim.wait(30) == -signal.SIGKILL
  out = writers.outcome(job.start(tmp_path, 0))
  assert out["error"] == "BarrierTimeoutError", out
  assert "process(es) [1]" in out["message"], out
  assert _committed(job.url) == [5]
  assert _attempts(ckpt_dir) == [rel]  # left, invisible
  # The next save removes it (its holder, process 0's writer, is gone).
  assert ckptr.save(8, st)
  assert _attempts(ckpt_dir) == [] and _committed(job.url) == [5, 8]
  writers.assert_same(ckptr.restore(5), earlier)
  writers.assert_same(ckptr.restore(8), st)


@pytest.mark.parametrize("kill_at", ["before rename"])
def test_process_0_killed_mid_commit_leaves_nothing_partial(
    tmp_path, ckpt_dir, source, make_ckptr, rng, kill_at):
  st, src = source
  ckptr = make_ckptr(async_save=False)
  earlier = writers.state(rng, 1)
  assert ckptr.save(5, earlier)
  job = writers.Job(os.fspath(ckpt_dir), src, 2)
  job.prepare()
  other = job.start(tmp_path, 1, bound_s=5.0)  # (it waits, then says)
  committer = job.start(tmp_path, 0, kill_at=kill_at)
  writers.expect_line(committer, "committing")
  committer.send_signal(signal.SIGKILL)
  assert committer.wait(30) == -signal.SIGKILL
  assert writers.outcome(other)["committed"] is False
  assert _committed(job.url) == [5]
  assert not (ckpt_dir / f"checkpoint_{job.step}").exists()
  writers.assert_same(make_ckptr().restore(), earlier)  # the latest: 5
  # The next save of the same step replaces the dead attempt.
  assert ckptr.save(job.step, st)
  assert _attempts(ckpt_dir) == [] and _committed(job.url) == [5, job.step]
  writers.assert_same(make_ckptr().restore(job.step), st)


# ---- process 0's writer is this test (in-process), the others too ---------

def _commit(job: writers.Job, **kwargs) -> None:
  through_storage.commit_when_written(
      storage_lib.Storage(job.url), job.step, job.token, job.processes,
      job.index(), **{"bound_s": 2.0, **kwargs})


def test_a_record_of_another_attempt_is_never_counted(tmp_path, ckpt_dir,
                                                      source, make_ckptr):
  st, src = source
  old = writers.Job(os.fspath(ckpt_dir), src, 2)
  old_rel = old.prepare()
  writers.write_share(old, 1)  # attempt A-1's record of process 1
  job = writers.Job(os.fspath(ckpt_dir), src, 2)
  rel = job.prepare()
  writers.write_share(job, 0)
  os.makedirs(ckpt_dir / rel / ".writers", exist_ok=True)
  for name in ("1.msgpack",):  # lying in attempt A, where 1's would be
    (ckpt_dir / rel / ".writers" / name).write_bytes(
        (ckpt_dir / old_rel / ".writers" / name).read_bytes())
  with pytest.raises(BarrierTimeoutError, match=r"process\(es\) \[1\]"):
    _commit(job)
  assert _committed(job.url) == []
  writers.write_share(job, 1)  # the real one: now it commits
  _commit(job)
  assert _committed(job.url) == [job.step]
  writers.assert_same(make_ckptr().restore(job.step), st)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "not msgpack",
                                    "not a map", "wrong process",
                                    "a path outside"])
def test_a_damaged_record_commits_nothing(ckpt_dir, source, damage):
  _, src = source
  job = writers.Job(os.fspath(ckpt_dir), src, 2)
  rel = job.prepare()
  writers.write_share(job, 0)
  writers.write_share(job, 1)
  path = ckpt_dir / rel / ".writers" / "1.msgpack"
  data = bytearray(path.read_bytes())
  if damage == "flipped byte":
    data[5] ^= 1
  elif damage == "truncated":
    data = data[:-3]
  elif damage == "not msgpack":
    data = seal.seal(b"\xc1 not msgpack")
  elif damage == "not a map":
    data = seal.seal(msgpack.packb([job.step, job.token]))
  elif damage == "a path outside":
    doc = msgpack.unpackb(seal.unseal(bytes(data), "record"))
    doc["files"] = {"../../checkpoint_5/index.msgpack": 0}
    data = seal.seal(msgpack.packb(doc))
  else:  # process 0's record where process 1's should be
    data = (ckpt_dir / rel / ".writers" / "0.msgpack").read_bytes()
  path.write_bytes(bytes(data))
  with pytest.raises(through_storage.WriterFailedError, match="1.msgpack"):
    _commit(job)
  assert _committed(job.url) == []


def test_a_failed_writer_commits_nothing_and_its_attempt_goes(ckpt_dir,
                                                               source):
  _, src = source
  job = writers.Job(os.fspath(ckpt_dir), src, 2)
  rel = job.prepare()
  writers.write_share(job, 0)
  writers.write_share(job, 1, error="OSError: [Errno 28] No space left")
  with pytest.raises(through_storage.WriterFailedError,
                     match=r"process 1: OSError: \[Errno 28\]"):
    _commit(job)
  assert _committed(job.url) == []
  assert not (ckpt_dir / rel).exists()  # every writer had stopped


def test_a_file_a_record_names_must_be_intact(ckpt_dir, source):
  _, src = source
  job = writers.Job(os.fspath(ckpt_dir), src, 2)
  rel = job.prepare()
  writers.write_share(job, 0)
  writers.write_share(job, 1)
  host = ckpt_dir / rel / index_lib.process_file(index_lib.HOST_STATE_DIR, 0)
  host.write_bytes(host.read_bytes() + b"x")
  with pytest.raises(through_storage.WriterFailedError,
                     match="recorded crc32c"):
    _commit(job)
  assert _committed(job.url) == []


def test_every_array_written_exactly_once(ckpt_dir, source):
  _, src = source
  job = writers.Job(os.fspath(ckpt_dir), src, 2)
  job.prepare()
  writers.write_share(job, 0)
  share = job.share
  job.share = lambda p: (*share(p)[:2], share(0)[2])  # 1 claims 0's boxes
  writers.write_share(job, 1)
  with pytest.raises(through_storage.WriterFailedError,
                     match="exactly once"):
    _commit(job, whole=list(tiling.whole(src.arrays)))
  assert _committed(job.url) == []


def test_a_removed_attempt_never_commits(ckpt_dir, source):
  _, src = source
  job = writers.Job(os.fspath(ckpt_dir), src, 2)
  rel = job.prepare()
  st = storage_lib.Storage(job.url)
  renewal = through_storage.hold_lease(st, job.step, job.token)
  writers.write_share(job, 0)
  writers.write_share(job, 1)
  cleanup_lib.remove(st, rel)  # a cleaner, `ckpt gc`, a person
  with pytest.raises(CheckpointError, match="its work was removed"):
    _commit(job, renewal=renewal)
  assert _committed(job.url) == [] and _attempts(ckpt_dir) == []


def test_a_step_committed_by_another_attempt_stays(ckpt_dir, source,
                                                   make_ckptr, rng):
  st, src = source
  job = writers.Job(os.fspath(ckpt_dir), src, 2)
  job.prepare()
  writers.write_share(job, 0)
  writers.write_share(job, 1)
  newer = writers.state(rng, 1)
  assert make_ckptr(async_save=False).save(job.step, newer)  # wins first
  with pytest.raises(CheckpointError, match="another attempt committed it"):
    _commit(job)
  writers.assert_same(make_ckptr().restore(job.step), newer)


def test_wait_committed_says_no_once_the_attempt_is_gone(ckpt_dir, source):
  _, src = source
  job = writers.Job(os.fspath(ckpt_dir), src, 2)
  rel = job.prepare()
  st = storage_lib.Storage(job.url)
  assert not through_storage.wait_committed(st, job.step, job.token, 0.2)
  commit_lib.commit(st, job.step, job.token, job.index())  # (index only)
  assert through_storage.wait_committed(st, job.step, job.token, 0.2)
  other = writers.Job(os.fspath(ckpt_dir), src, 2, step=9)
  other_rel = other.prepare()
  cleanup_lib.remove(st, other_rel)
  assert not through_storage.wait_committed(st, 9, other.token, 60)
  del rel


def test_hold_lease_of_a_removed_attempt_fails(ckpt_dir, source):
  _, src = source
  job = writers.Job(os.fspath(ckpt_dir), src, 2)
  rel = job.prepare()
  st = storage_lib.Storage(job.url)
  cleanup_lib.remove(st, rel)
  with pytest.raises(CheckpointError, match="its work was removed"):
    through_storage.hold_lease(st, job.step, job.token)
  assert _attempts(ckpt_dir) == []  # never recreated


def test_a_stopped_wait_commits_nothing(ckpt_dir, source):
  _, src = source
  job = writers.Job(os.fspath(ckpt_dir), src, 2)
  job.prepare()
  writers.write_share(job, 0)
  stop = threading.Event()
  stop.set()
  with pytest.raises(CheckpointError, match="stopped; nothing was committed"):
    _commit(job, bound_s=60.0, stop=stop)
  writers.write_share(job, 1)  # too late: nothing commits by itself
  assert _committed(job.url) == []


def test_a_record_names_only_its_own_process_files(ckpt_dir, source):
  _, src = source
  job = writers.Job(os.fspath(ckpt_dir), src, 2)
  job.prepare()
  st = storage_lib.Storage(job.url)
  for files in ({"../x": b""}, {index_lib.process_file(
      index_lib.HOST_STATE_DIR, 0): b""}):
    with pytest.raises(ValueError, match="not a per-process file of process 1"):
      through_storage.write_record(st, job.step, job.token, 1, 2, files=files)
  with pytest.raises(ValueError, match=r"process must be an int in \[0, 2\)"):
    through_storage.write_record(st, job.step, job.token, 2, 2)
