"""What finding the steps costs on a bucket, and the flat commit records.

The LIST requests of a save, a restore, ``metrics()`` and a restarted job's
first save are counted from moto's access log: they do not depend on the
number of chunks (8 or 600; two steps of 600 chunks are more keys than one
page of a listing holds) nor on the number of steps. On both servers,
ckpt lists only the flat prefixes (``commits/``, ``pending/``) and, when it
deletes a step, that step's keys.
The rest: a deletion never leaves a listed step without data, a commit that
dies between its marker and its record is not a step and is cleaned up,
and a root written before records existed is still discovered (and
migrated by its first save).
"""

from __future__ import annotations

import collections
import json
import os
import re
import time

import numpy as np
import pytest

import ckpt
from ckpt.cli import main as cli
from ckpt.commit import steps as steps_lib
from ckpt.commit import cleanup as cleanup_lib
from ckpt.commit import lease as lease_lib
from ckpt.save import runner as finalize
from ckpt.commit import records
from ckpt.store import storage as storage_lib
from ckpt.store import names
from tests.objectstore import storeutil

_LINE_RE = re.compile(r'"([A-Z]+) (\S+) HTTP/[0-9.]+" (\d{3})')
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
PER_CHUNK = 256  # float32 elements: 1 KiB chunks with chunk_bytes=1024
KW = dict(async_save=False, chunk_bytes=1024)


def state(chunks: int, step: int) -> dict:
  return {"w": np.full(chunks * PER_CHUNK, step, np.float32),
          "n": np.int64(step)}


def count_requests(server, url: str, fn) -> collections.Counter:
  """The requests ``fn()`` sent to ``url``'s bucket, by kind (LIST: a GET
  of the bucket with a listing query), from moto's access log."""
  bucket = url.split("/")[2]
  offset = os.path.getsize(server.log_path)
  fn()
  size, since = -1, time.monotonic()  # moto logs a request after answering
  while time.monotonic() - since < 0.3:
    if os.path.getsize(server.log_path) != size:
      size, since = os.path.getsize(server.log_path), time.monotonic()
    time.sleep(0.05)
  with open(server.log_path, "rb") as f:
    f.seek(offset)
    text = _ANSI_RE.sub("", f.read().decode(errors="replace"))
  out = collections.Counter()
  for m in _LINE_RE.finditer(text):
    method, target = m.group(1), m.group(2)
    path, _, query = target.partition("?")
    parts = [p for p in path.split("/") if p]
    if not parts or parts[0] != bucket:
      continue
    listing = method == "GET" and len(parts) == 1 and (
        "list-type" in query or "prefix=" in query)
    out["LIST" if listing else method] += 1
  return out


def lists_per_operation(server, url: str, chunks: int, steps: int) -> dict:
  """LIST requests of: a save (the ``steps``-th, by a Checkpointer that
  saved before), a restarted job's restore, its ``all_steps`` and
  ``metrics`` of every step, and its first save (of 8 chunks: what it
  could list is what the steps before left, already more than a page with
  600 chunks a step; a step of its own size, a page either way, would only
  make it longer)."""
  out, gets = {}, {}
  with ckpt.Checkpointer(url, **KW) as writer:
    for s in range(1, steps):
      writer.save(s, state(chunks, s), metrics={"loss": 1.0 / s})
    c = count_requests(server, url, lambda: writer.save(
        steps, state(chunks, steps), metrics={"loss": 1.0 / steps}))
    assert c["PUT"] >= chunks, c  # it did write every chunk
    out["save"] = c["LIST"]
  with ckpt.Checkpointer(url, **KW) as restarted:
    got = {}
    c = count_requests(server, url, lambda: got.update(restarted.restore()))
    assert int(got["n"]) == steps
    out["restore"] = c["LIST"]
    c = count_requests(server, url, lambda: [
        restarted.metrics(s) for s in restarted.all_steps()])
    out["metrics"], gets["metrics"] = c["LIST"], c["GET"]
    c = count_requests(server, url, lambda: restarted.save(
        steps + 1, state(8, steps + 1)))
    out["first_save"] = c["LIST"]
  # The operator's view: `ckpt ls` and a dry-run `ckpt gc`.
  for name, argv in (("ls", ["ls", url, "--json"]),
                     ("gc", ["gc", url, "--keep", "1", "--json"])):
    c = count_requests(server, url, lambda: cli.main(argv))
    out[name] = c["LIST"]
  # metrics() after a restart: one GET per step (its commit record).
  assert gets["metrics"] == steps, gets
  return out


def test_lists_do_not_grow_with_chunks_or_steps(s3_server, s3_bucket):
  few = lists_per_operation(s3_server, f"{s3_bucket}/few", chunks=8, steps=2)
  many = lists_per_operation(s3_server, f"{s3_bucket}/many", chunks=600,
                             steps=2)
  longer = lists_per_operation(s3_server, f"{s3_bucket}/longer", chunks=8,
                               steps=6)
  # One listing of commits/ per discovery, one of pending/ per save (its
  # cleanup of abandoned attempts), one of the step's .checksums/ per
  # restore (what the index claims is compared with what the step holds
  # before any per-process read: ckpt/restore/listed.py); ls and gc list
  # both (committed steps,
  # abandoned attempts), never the chunks (`ckpt ls --objects` does:
  # test_ls_counts_objects_on_request).
  want = {"save": 1, "restore": 2, "metrics": 1, "first_save": 1, "ls": 2,
          "gc": 2}
  assert few == want, few
  assert many == want, many
  assert longer == want, longer


def test_ls_counts_objects_on_request(s3_server, s3_bucket, capsys):
  """Without --objects a bucket's FILES are unknown ("-", null in JSON);
  with it, each step's objects are counted from one full listing (2,000+
  keys here: more than one page)."""
  url = f"{s3_bucket}/ls"
  with ckpt.Checkpointer(url, **KW) as ckptr:
    ckptr.save(1, state(1000, 1))
    ckptr.save(2, state(8, 2))
  capsys.readouterr()
  assert cli.main(["ls", url, "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)["steps"]
  assert [(r["step"], r["status"], r["files"]) for r in rows] == [
      (1, "committed", None), (2, "committed", None)]
  assert cli.main(["ls", url]) == 0
  text = capsys.readouterr().out
  assert [line.split()[3] for line in text.splitlines()[1:3]] == ["-", "-"]
  c = count_requests(s3_server, url, lambda: cli.main(
      ["ls", url, "--objects", "--json"]))
  rows = json.loads(capsys.readouterr().out)["steps"]
  keys = storeutil.keys(url)
  for r in rows:
    assert r["files"] == sum(k.startswith(f"checkpoint_{r['step']}/")
                             for k in keys) > 0, r
  assert rows[0]["files"] > 1000 > rows[1]["files"]
  assert c["LIST"] >= 4, c  # commits/, pending/, and 2+ pages of chunks


@pytest.mark.parametrize("store", ["s3", "gs"])
def test_only_flat_prefixes_are_listed(store, s3_bucket, gs_bucket, listed):
  url = f"{s3_bucket if store == 's3' else gs_bucket}/flat"
  with ckpt.Checkpointer(url, keep=2, best_metric="loss", format="zarr3",
                         **KW) as ckptr:
    for s in range(1, 6):
      ckptr.save(s, state(8, s), metrics={"loss": float(s % 3)})
      ckptr.wait_until_finished()
    steps = ckptr.all_steps()
    ckptr.restore()
  with ckpt.Checkpointer(url, **KW) as ckptr:
    assert ckptr.all_steps() == steps
    assert {s: ckptr.metrics(s)["loss"] for s in steps} == {
        s: float(s % 3) for s in steps}
    ckptr.restore(steps[0])
  deleted = set(range(1, 6)) - set(steps)
  assert deleted
  step_prefixes = {p for p in listed if p.startswith("checkpoint_")}
  # The whole-root listing happened once: the first save of the fresh root
  # (its migration, which found nothing); then only the deleted steps' own
  # data: the attempt each deletion names.
  assert [p for p in listed if p == "checkpoint_"] == ["checkpoint_"], listed
  own = step_prefixes - {"checkpoint_"}
  assert {p.split("/")[0] for p in own} == {f"checkpoint_{s}"
                                            for s in deleted}, listed
  assert all(re.fullmatch(r"checkpoint_\d+/attempt-[0-9a-f]+/", p)
             for p in own), listed
  assert set(listed) - step_prefixes <= {"commits/", "pending/"}, listed


@pytest.mark.parametrize("store", ["s3", "gs"])
def test_a_deleted_step_is_unlisted_before_its_data_goes(
    store, s3_bucket, gs_bucket, monkeypatch):
  url = f"{s3_bucket if store == 's3' else gs_bucket}/delete"
  seen = []
  real = storage_lib.Storage.delete_keys

  def check_first(self, keys, what):
    for step in sorted({names.parse_step(k.split("/")[0]) for k in keys}
                       - {None}):
      # Whoever lists the steps right now (another process, another job)
      # no longer sees the step whose data is about to go.
      # (Checked below: retention logs the errors of its deletions.)
      seen.append((step, steps_lib.committed_steps(storage_lib.Storage(url))))
    return real(self, keys, what)
  monkeypatch.setattr(storage_lib.Storage, "delete_keys", check_first)
  with ckpt.Checkpointer(url, keep=2, format="zarr3", **KW) as ckptr:
    for s in range(1, 6):
      ckptr.save(s, state(8, s))
      ckptr.wait_until_finished()
      for kept in ckptr.all_steps():  # every listed step is whole
        assert int(ckptr.restore(kept)["n"]) == kept
    ckptr.delete(4)
    assert ckptr.all_steps() == [5]
  assert sorted({s for s, _ in seen}) == [1, 2, 3, 4], seen
  assert not [(s, listed) for s, listed in seen if s in listed], seen
  keys = storeutil.keys(url)
  assert not [k for k in keys if k.startswith("pending/")], keys
  assert sorted(k for k in keys if k.startswith("commits/")) == [
      "commits/5", "commits/complete"]


def _crash_between_marker_and_record(monkeypatch, url: str, step: int):
  """A save of ``step`` whose process dies after the commit marker, before
  the record: nothing of it is cleaned up."""
  real = storage_lib.Storage.write_bytes

  def write(self, rel, data):
    if rel == records.record_key(step):
      raise RuntimeError("killed between the marker and the record")
    return real(self, rel, data)
  with monkeypatch.context() as m:
    m.setattr(storage_lib.Storage, "write_bytes", write)
    m.setattr(finalize, "_remove_failed", lambda *a: None)
    with ckpt.Checkpointer(url, **KW) as ckptr:
      with pytest.raises(ckpt.CheckpointError, match="killed between"):
        ckptr.save(step, state(8, step))
  keys = storeutil.keys(url)
  assert f"checkpoint_{step}/commit_success" in keys, keys
  assert records.record_key(step) not in keys
  [pending] = [k for k in keys if k.startswith(f"pending/{step}.")]
  return pending


@pytest.mark.parametrize("store", ["s3", "gs"])
def test_crash_between_marker_and_record(store, s3_bucket, gs_bucket,
                                         monkeypatch, capsys):
  url = f"{s3_bucket if store == 's3' else gs_bucket}/crash"
  with ckpt.Checkpointer(url, **KW) as ckptr:
    ckptr.save(1, state(8, 1))
  _crash_between_marker_and_record(monkeypatch, url, 2)
  with ckpt.Checkpointer(url, **KW) as ckptr:
    assert ckptr.all_steps() == [1]
    assert ckptr.latest_step() == 1
    with pytest.raises(ckpt.CheckpointNotFoundError):
      ckptr.restore(2)
    assert int(ckptr.restore()["n"]) == 1
  # `ckpt gc` removes it: its marker, its data and its pending record.
  assert cli.main(["gc", url, "--tmp-min-age", "0", "--yes"]) == 0
  capsys.readouterr()
  keys = storeutil.keys(url)
  assert not [k for k in keys if k.startswith(("checkpoint_2/", "pending/"))]
  # Again; this time the next save of that step, once the dead attempt's
  # lease is over, replaces it.
  _crash_between_marker_and_record(monkeypatch, url, 2)
  with ckpt.Checkpointer(url, lease_s=1e-3, **KW) as ckptr:
    # Its holder (this process) is alive: on a bucket a lease is dated by
    # the cleaner's own sightings (ckpt/commit/lease.py), so this one is
    # seen once, then found unchanged by the save's prepare.
    cleanup_lib.abandoned(ckptr.storage, ckptr.lease_s, None,
                          ckptr.lease_seen)
    time.sleep(0.01)
    assert ckptr.save(2, state(8, 2))
    assert ckptr.all_steps() == [1, 2]
    assert int(ckptr.restore(2)["n"]) == 2
  keys = storeutil.keys(url)
  marker = json.loads(storeutil.read_key(url, "checkpoint_2/commit_success"))
  assert {k.split("/")[1] for k in keys if k.startswith("checkpoint_2/")
          } == {"commit_success", marker["dir"]}
  assert not [k for k in keys if k.startswith("pending/")]


def test_a_failed_record_write_removes_the_marker(s3_bucket, monkeypatch):
  """A save whose record cannot be written fails, and its attempt (marker
  included) is removed at once: the step can be saved again right away."""
  url = f"{s3_bucket}/failed-record"
  real = storage_lib.Storage.write_bytes

  def write(self, rel, data):
    if rel == records.record_key(1):
      raise ckpt.CheckpointError("the store refused the record")
    return real(self, rel, data)
  with ckpt.Checkpointer(url, **KW) as ckptr:
    with monkeypatch.context() as m:
      m.setattr(storage_lib.Storage, "write_bytes", write)
      with pytest.raises(ckpt.CheckpointError, match="refused the record"):
        ckptr.save(1, state(8, 1))
    assert not [k for k in storeutil.keys(url)
                if k.startswith(("checkpoint_1/", "pending/"))]
    assert ckptr.save(1, state(8, 1))
    assert ckptr.all_steps() == [1]


def _as_before_records(url: str) -> None:
  """Makes a root look written by a ckpt without records: markers only."""
  for k in storeutil.keys(url):
    if k.startswith(("commits/", "pending/")):
      storeutil.delete_key(url, k)


@pytest.mark.parametrize("store", ["s3", "gs"])
def test_a_root_without_records_is_discovered_and_migrated(
    store, s3_bucket, gs_bucket, listed):
  url = f"{s3_bucket if store == 's3' else gs_bucket}/old"
  with ckpt.Checkpointer(url, **KW) as ckptr:
    for s in (1, 2, 3):
      ckptr.save(s, state(8, s), metrics={"loss": s / 2})
  _as_before_records(url)
  # An attempt that never committed, in the old layout, long dead.
  storeutil.write_key(url, "checkpoint_4/attempt-abc/attempt.json",
                      json.dumps({"token": "abc", "time": 0}).encode())
  storeutil.write_key(url, "checkpoint_4/attempt-abc/w/zarr.json", b"{}")
  listed.clear()
  with ckpt.Checkpointer(url, **KW) as ckptr:  # a reader: changes nothing
    assert ckptr.all_steps() == [1, 2, 3]
    assert ckptr.metrics(2) == {"loss": 1.0}
    assert int(ckptr.restore()["n"]) == 3
    # Dated by the cleaner's own sightings (ckpt/commit/lease.py), never
    # by the time the holder wrote: abandoned once seen unchanged for 0.05 s.
    seen = lease_lib.Sightings()
    assert cleanup_lib.abandoned(ckptr.storage, 0.05, None, seen) == []
    time.sleep(0.06)
    assert cleanup_lib.abandoned(ckptr.storage, 0.05, None, seen) == [
        "checkpoint_4/attempt-abc"]
  assert "checkpoint_" in listed  # the full listing, while not migrated
  assert not [k for k in storeutil.keys(url) if k.startswith("commits/")]
  with ckpt.Checkpointer(url, lease_s=0.05, **KW) as ckptr:  # a writer
    ckptr.lease_seen = seen  # (what it saw before), then it migrates first
    ckptr.save(5, state(8, 5), metrics={"loss": 0.5})
    assert ckptr.all_steps() == [1, 2, 3, 5]
  keys = storeutil.keys(url)
  assert "commits/complete" in keys
  assert not [k for k in keys if k.startswith(("checkpoint_4/", "pending/"))]
  listed.clear()
  with ckpt.Checkpointer(url, **KW) as ckptr:
    assert ckptr.all_steps() == [1, 2, 3, 5]
    # The migrated records hold the metrics the indexes had.
    assert {s: ckptr.metrics(s) for s in (1, 5)} == {1: {"loss": 0.5},
                                                    5: {"loss": 0.5}}
    assert int(ckptr.restore(1)["n"]) == 1
  assert set(listed) == {"commits/"}, listed


def test_a_bucket_root_copied_to_disk_and_back(s3_bucket, gs_bucket,
                                               tmp_path):
  """The disk does not maintain the bucket's records, so its first save
  drops them: copied back to a bucket, the root is discovered whole."""
  src = f"{s3_bucket}/src"
  with ckpt.Checkpointer(src, **KW) as ckptr:
    ckptr.save(1, state(8, 1))
  disk = str(tmp_path / "disk")
  storeutil.copy_tree(src, disk)
  assert os.path.isfile(os.path.join(disk, "commits", "complete"))
  with ckpt.Checkpointer(disk, **KW) as ckptr:
    assert ckptr.all_steps() == [1]
    ckptr.save(2, state(8, 2))
  assert not os.path.exists(os.path.join(disk, "commits"))
  dst = f"{gs_bucket}/back"
  storeutil.copy_tree(disk, dst)
  with ckpt.Checkpointer(dst, **KW) as ckptr:
    assert ckptr.all_steps() == [1, 2]
    assert int(ckptr.restore()["n"]) == 2
