"""Read once (ckpt/restore/readonce.py) across real processes, on the local disk.

4 processes x 2 devices save a state fully sharded, then restore it onto
leaves replicated over 4 processes, over 2, and fully sharded, with
``read_once`` True, False and None (automatic: off on a disk). The bytes
read from storage come from ``Checkpointer.last_restore_stats.bytes_read``
(counted in ckpt's read path, LazyArray): read once, their sum over the
processes is the stored bytes of the target's leaves, each process within
1.5x of an equal share; read everywhere it is R times that per leaf. Every
shard is bit-exact with the target's sharding in both. The read-once restore
runs with ``verify=True``, which checks each chunk each process reads as it
reads it (no second read).

The same launch then restores read once with what else a restore takes
(the worker's ``cases``): ``lazy=True`` leaves read later (each read a
collective; read once off for comparison), ``restore_dtype``, a rename
transform with a fallback leaf, a ``concurrent_bytes`` small enough to cut
the exchange into several batches, and the state saved again as "ocdbt".
Each must read the stored bytes once in total, bit-exact, in the target's
sharding (read everywhere, the byte count would be ``everywhere_bytes``).
"""

from __future__ import annotations

import math

import numpy as np

from tests.multiprocess import launch as launch_lib
from tests.multiprocess import readonce_worker as worker

WORKER = "tests.multiprocess.readonce_worker"
BALANCE = 1.5
# Processes holding the same box of each leaf (4 x 2 mesh a=2, b=2, c=2).
REPLICAS = {"rep4/w": 4, "rep4/all": 4, "rep4/i": 4, "rep2/w": 2,
            "shard/w": 1}


def stored_bytes() -> int:
  return sum(math.prod(s) * np.dtype(d).itemsize
             for s, d, _ in worker.SHAPES.values())


def everywhere_bytes() -> int:
  return sum(math.prod(s) * np.dtype(d).itemsize * REPLICAS[n]
             for n, (s, d, _) in worker.SHAPES.items())


def launch(config: dict, n: int = 4) -> list[worker.Result]:
  return launch_lib.launch(WORKER, config, n, 2, result=worker.Result)


def check_counts(out: list[worker.Result], policy: str, expect_total: int,
                 balanced: bool) -> list[int]:
  per = [r.restores[policy].stats["bytes_read"] for r in out]
  for r in out:
    assert r.restores[policy].bad == [], r.restores[policy].bad
  assert sum(per) == expect_total, (policy, per, expect_total)
  if balanced:
    share = expect_total / len(per)
    assert max(per) <= BALANCE * share, (policy, per)
  return per


def test_read_once_on_disk(tmp_path):
  config = {"dir": str(tmp_path / "ck"), "format": "zarr3"}
  out = launch({**config, "op": "both", "policies": [True, False, None],
                "verify": [True],
                "cases": ["lazy", "dtype", "fallback", "batches", "ocdbt"]})
  # verify=True checks each chunk as it is read: no second read.
  check_counts(out, "True", stored_bytes(), balanced=True)
  check_counts(out, "False", everywhere_bytes(), balanced=True)
  # Automatic on a local disk: off (reading is cheaper than exchanging).
  check_counts(out, "None", everywhere_bytes(), balanced=True)
  for r in out:
    s = r.restores["True"].stats
    assert s["read_once_leaves"] == 4 and s["batches"] >= 1
    assert r.restores["False"].stats["read_once_leaves"] == 0
  check_cases(out, stored_bytes(), everywhere_bytes(), 4)


READ_ONCE_LEAVES = ["rep4/w", "rep4/all", "rep4/i", "rep2/w"]


def check_cases(out: list[worker.Result], stored: int, everywhere: int,
                leaves: int) -> None:
  """The worker's ``cases`` (those it ran): each read once, bit-exact."""
  ran = set(out[0].restores)
  if "lazy-True" in ran:
    # The restore reads nothing; the leaves' reads, later, read once.
    assert [r.restores["lazy-True"].before for r in out] == [0] * len(out)
    check_counts(out, "lazy-True", stored, balanced=True)
    check_counts(out, "lazy-False", everywhere, balanced=True)
    for r in out:
      lazy, eager = r.restores["lazy-True"], r.restores["lazy-False"]
      assert lazy.read_once == READ_ONCE_LEAVES[:leaves]
      assert lazy.stats["read_once_leaves"] == leaves
      assert eager.read_once == []
      assert eager.stats["read_once_leaves"] == 0
    # Read with another sharding (P(), process 0 alone): the whole leaf,
    # read as usual, no exchange.
    assert out[0].restores["lazy-True"].other_sharding == worker.OtherSharding(
        bytes=math.prod(worker.SHAPES["rep4/i"][0]) * 4, exchanged=0,
        exact=True)
  for case in ("dtype", "fallback", "batches", "ocdbt"):
    if case in ran:
      check_counts(out, case, stored, balanced=True)
      for r in out:
        assert r.restores[case].stats["read_once_leaves"] == leaves, (case, r)
  if "batches" in ran:
    for r in out:
      s = r.restores["batches"].stats
      assert s["batches"] > 1, s
      # Measured: parts read + gathered arrays of the largest batch.
      assert 0 < s["peak_batch_bytes"] <= worker.BATCH_BYTES, s
      assert 0 < s["peak_read_bytes"] <= worker.BATCH_BYTES, s


def test_a_process_failing_before_the_exchange_fails_the_restore_on_all(
    tmp_path):
  """A restore transform raises on process 1 only: instead of process 0
  waiting in an all-gather process 1 never joins, both raise (process 0
  naming process 1), and the next restore works on both. Then, format
  "zarr": restore(verify=True) over both processes' checksum files, exact;
  and with a flipped byte, both processes raise (the reader of that chunk
  its crc32c mismatch, the other naming it)."""
  out = launch({"dir": str(tmp_path / "ck"), "op": "both", "policies": [True],
                "verify": [True], "fail_on": 1, "corrupt": True}, n=2)
  p0, p1 = out
  # Format "zarr", verify=True: the crc32c of every chunk each process reads
  # comes from the checksum files both processes wrote, checked as it is
  # read (no second read: the stored bytes once); all exact.
  for r in out:
    assert r.restores["True"].bad == [], r.restores["True"]
  assert sum(r.restores["True"].stats["bytes_read"] for r in out
             ) == stored_bytes()
  f0, f1 = p0.failures, p1.failures
  assert f1.fail.type == "ValueError", f1
  assert f1.fail.msg.startswith("boom"), f1
  assert "failed on process 1 of 2" in f0.fail.msg, f0
  assert "boom" in f0.fail.msg, f0
  assert f0.after_fail == f1.after_fail == 7
  # The same for a lazy leaf read once (its read is the collective): process
  # 1's read fails (its step guard raises there), process 0's names it; the
  # next lazy read (the next round) works on both, read once.
  assert f1.lazy_fail.type == "ValueError", f1
  assert f1.lazy_fail.msg.startswith("step gone"), f1
  assert "process(es) [1]" in f0.lazy_fail.msg, f0
  assert "step gone" in f0.lazy_fail.msg, f0
  # A read cancelled on process 1 after it took its round: process 0's read
  # of the same leaf raises naming process 1 instead of waiting.
  assert f1.lazy_cancel.value == "cancelled", f1
  assert "process(es) [1]" in f0.lazy_cancel.error.msg, f0
  for f in (f0, f1):
    assert f.lazy_after_fail == [], f
    assert f.lazy_after_fail_stats["read_once_leaves"] == 1, f
  # Lazy read-once reads in a different order on the two processes: same
  # shape and dtype (rep4/w, rep2/w: before, each process silently got half
  # of each leaf), then different ones (rep4/w, rep4/i: before, gloo aborted
  # the job). Every read raises on both, naming both leaves; the same order
  # then reads both exactly.
  for other in ("rep2/w", "rep4/i"):
    for p in out:
      r = p.failures.lazy_order[other]
      for got in r.got:
        assert got.error is not None and got.error.type == "CheckpointError", r
        msg = got.error.msg
        assert "'rep4/w'" in msg and f"'{other}'" in msg, msg
        assert "same order" in msg, msg
      assert r.again == [[], []], r
  # One byte flipped in a chunk of rep4/w (zarr v2: no codec checksum):
  # without verify the restore returns wrong data, read once onto both
  # processes; with verify=True both raise the same error, naming the
  # process that read that chunk and its crc32c mismatch.
  for p in out:
    assert p.corrupt["False"] == worker.Corrupt(None, False), p
    assert "rep4/w" in p.corrupt["True"].error.msg, p
  errors = [p.corrupt["True"].error for p in out]
  # The same error on both, naming the reader of that chunk.
  assert errors[0] == errors[1], errors
  assert errors[0].type == "CorruptCheckpointError", errors
  msg = errors[0].msg
  assert msg.startswith("restore of step "), errors
  assert "CorruptCheckpointError: leaf 'rep4/w': box" in msg, errors
  assert "has crc32c" in msg, errors
  assert ("failed on process 0 of 2" in msg or
          "failed on process 1 of 2" in msg), errors
