"""The commit through the storage (ckpt/commit/through_storage.py) on S3
(moto) and GCS (the emulator): writer processes with no coordination
service alive (tests/commit/writers.py says how a job is made).
"""

from __future__ import annotations

import signal
import time

import pytest

from ckpt.commit import steps as steps_lib
from ckpt.commit import through_storage
from ckpt.errors import BarrierTimeoutError, CheckpointError, StoreTimeoutError
from ckpt.store import deadline as deadline_lib
from ckpt.store import storage as storage_lib
from tests.commit import writers


@pytest.fixture(params=["s3", "gs"])
def bucket(request):
  return request.getfixturevalue(f"{request.param}_bucket") + "/run"


@pytest.fixture
def source(tmp_path, rng):
  st = writers.state(rng, 2)
  return st, writers.saved(tmp_path, st)


def _committed(url: str) -> list[int]:
  return steps_lib.committed_steps(storage_lib.Storage(url))


def _pending(url: str) -> list[str]:
  return storage_lib.Storage(url).list_keys("pending/")


def test_two_writers_commit_and_restore_bit_exact(tmp_path, bucket, source,
                                                  store_env, make_ckptr):
  st, src = source
  job = writers.Job(bucket, src, 2)
  job.prepare()
  procs = [job.start(tmp_path, p, env=store_env) for p in (1, 0)]
  outs = [writers.outcome(p) for p in procs]
  assert all(o["committed"] for o in outs), outs
  assert _committed(bucket) == [job.step] and _pending(bucket) == []
  writers.assert_same(make_ckptr(bucket).restore(job.step), st)


def test_a_writer_killed_before_its_record_commits_nothing(
    tmp_path, bucket, source, store_env, make_ckptr, rng):
  st, src = source
  ckptr = make_ckptr(bucket, async_save=False)
  earlier = writers.state(rng, 1)
  assert ckptr.save(5, earlier)
  job = writers.Job(bucket, src, 2, bound_s=3.0)
  job.prepare()
  victim = job.start(tmp_path, 1, hold=True, env=store_env)
  writers.expect_line(victim, "ready")
  victim.send_signal(signal.SIGKILL)
  assert victim.wait(30) == -signal.SIGKILL
  out = writers.outcome(job.start(tmp_path, 0, env=store_env))
  assert out["error"] == "BarrierTimeoutError", out
  assert _committed(bucket) == [5]
  assert _pending(bucket) == [f"pending/{job.step}.{job.token}"]
  assert ckptr.save(8, st)  # cleans it up: its holder is gone
  assert _committed(bucket) == [5, 8] and _pending(bucket) == []
  assert not storage_lib.Storage(bucket).list_keys(f"checkpoint_{job.step}/")
  writers.assert_same(ckptr.restore(5), earlier)


@pytest.mark.parametrize("kill_at", ["after marker", "after record"])
def test_process_0_killed_mid_commit_leaves_nothing_partial(
    tmp_path, bucket, source, store_env, make_ckptr, rng, kill_at):
  """Killed once the marker is written (no record: not committed) or once
  the record is (committed, whole)."""
  st, src = source
  ckptr = make_ckptr(bucket, async_save=False)
  earlier = writers.state(rng, 1)
  assert ckptr.save(5, earlier)
  job = writers.Job(bucket, src, 2)
  job.prepare()
  other = job.start(tmp_path, 1, env=store_env, bound_s=5.0)
  committer = job.start(tmp_path, 0, kill_at=kill_at, env=store_env)
  writers.expect_line(committer, "committing")
  committer.send_signal(signal.SIGKILL)
  assert committer.wait(30) == -signal.SIGKILL
  writers.outcome(other)
  if kill_at == "after marker":
    assert _committed(bucket) == [5]
    writers.assert_same(make_ckptr(bucket).restore(), earlier)
    again = writers.state(rng, 1)
    assert ckptr.save(job.step, again)  # the stale marker goes first
    writers.assert_same(make_ckptr(bucket).restore(job.step), again)
  else:
    assert _committed(bucket) == [5, job.step]
    writers.assert_same(make_ckptr(bucket).restore(job.step), st)
    assert ckptr.save(8, st)  # its pending/ record goes with cleanup
  assert _pending(bucket) == []


def test_a_record_of_another_attempt_is_never_counted(bucket, source):
  _, src = source
  old = writers.Job(bucket, src, 2)
  old.prepare()
  writers.write_share(old, 1)
  job = writers.Job(bucket, src, 2)
  job.prepare()
  writers.write_share(job, 0)
  storage = storage_lib.Storage(bucket)
  storage.write_bytes(
      through_storage.record_key(steps_lib.work_dir(storage, job.step,
                                                    job.token), 1),
      storage.read_bytes(through_storage.record_key(
          steps_lib.work_dir(storage, old.step, old.token), 1)))
  with pytest.raises(BarrierTimeoutError, match=r"process\(es\) \[1\]"):
    through_storage.commit_when_written(storage, job.step, job.token, 2,
                                        job.index(), bound_s=2.0)
  assert _committed(bucket) == []
  writers.write_share(job, 1)
  through_storage.commit_when_written(storage, job.step, job.token, 2,
                                      job.index(), bound_s=2.0)
  assert _committed(bucket) == [job.step]


def test_a_damaged_record_commits_nothing(bucket, source):
  _, src = source
  job = writers.Job(bucket, src, 2)
  job.prepare()
  writers.write_share(job, 0)
  writers.write_share(job, 1)
  storage = storage_lib.Storage(bucket)
  key = through_storage.record_key(
      steps_lib.work_dir(storage, job.step, job.token), 1)
  data = bytearray(storage.read_bytes(key))
  data[5] ^= 1
  storage.write_bytes(key, bytes(data))
  with pytest.raises(through_storage.WriterFailedError, match="1.msgpack"):
    through_storage.commit_when_written(storage, job.step, job.token, 2,
                                        job.index(), bound_s=2.0)
  assert _committed(bucket) == []


def test_a_dead_store_ends_the_wait_at_the_stall_bound(tmp_path, proxied, rng):
  """A store that stops answering while process 0's writer waits for the
  records: under the save's stall deadline (as the writer runs it) the
  wait ends within that bound, and nothing is committed."""
  px, url = proxied
  src = writers.saved(tmp_path, writers.state(rng, 2))
  job = writers.Job(url, src, 2)
  job.prepare()
  writers.write_share(job, 0)
  storage = storage_lib.Storage(url)
  px.black_hole()
  t0 = time.monotonic()
  with pytest.raises(CheckpointError) as e:
    with deadline_lib.scope(deadline_lib.Deadline(2.0, "save_timeout_s")):
      through_storage.commit_when_written(storage, job.step, job.token, 2,
                                          job.index(), bound_s=60.0)
  waited = time.monotonic() - t0
  assert isinstance(e.value, StoreTimeoutError), e.value
  assert waited < 15, waited  # the stall bound (2 s), not bound_s (60 s)
  print(f"\nthe wait on a dead store ended after {waited:.1f} s "
        "(stall bound 2 s)")
  px.resume()
  assert _committed(url) == []
