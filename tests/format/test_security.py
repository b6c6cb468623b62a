"""A checkpoint from a stranger: reading it is bounded in time and memory.

One test per hostile file of issue 17 (each fails on the code before it):
an index that is an array of a billion nils, an index with many duplicated
leaf paths, a leaf with a huge shape, array metadata on disk that disagrees
with the index (one chunk for the whole array, a zstd bomb), and an OCDBT
B+tree that points outside the checkpoint. Time is wall-clock, memory is the
peak python allocation (tracemalloc) of the call.
"""

import json
import os
import shutil
import struct
import threading
import time
import tracemalloc

import crc32c
import msgpack
from tests import sealed
import numpy as np
import pytest
import tensorstore as ts

import ckpt
from ckpt.cli import main as cli
from ckpt.format import index as index_lib
from ckpt.format import index_codec
from ckpt.restore import hostmem
from ckpt.store import ocdbt
from ckpt.store import storage as storage_lib
from ckpt.format import tree
from ckpt.format import tsspec
from ckpt.format import entries as entries_lib


@pytest.fixture(scope="module", autouse=True)
def _arrays_only(arrays_only):
  """Small test arrays stay TensorStore arrays (tests/save/test_pack.py covers
  packed leaves)."""
  del arrays_only


MiB = 1 << 20


def measured(fn, *args, **kwargs):
  """(result or raised exception, CPU seconds of this process, peak MiB
  allocated by python). CPU time, not wall time: the bound is on the work a
  hostile input makes us do, which a loaded machine does not change."""
  tracemalloc.start()
  t0 = time.process_time()
  try:
    out = fn(*args, **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    out = e
  seconds = time.process_time() - t0
  peak = tracemalloc.get_traced_memory()[1] / MiB
  tracemalloc.stop()
  return out, seconds, peak


def timed(fn, *args):
  """(result or raised exception, seconds)."""
  t0 = time.perf_counter()
  try:
    out = fn(*args)
  except Exception as e:  # pylint: disable=broad-except
    out = e
  return out, time.perf_counter() - t0


def save(root, fmt="zarr", **state):
  state = state or {"w": np.arange(64 * 256, dtype=np.float32).reshape(64, 256)}
  with ckpt.Checkpointer(root, async_save=False, format=fmt,
                         chunk_bytes=4096) as c:
    c.save(1, state)
  return root / "checkpoint_1"


def index_doc(step):
  """The step's index document, its leaves as version 1's maps (to edit)."""
  doc = sealed.unpackb((step / "index.msgpack").read_bytes(), raw=False)
  doc["leaves"] = index_codec.rows(doc["leaves"])
  return doc


def write_index(step, doc):
  """Writes an edited document back as today's version (leaf columns)."""
  doc = {**doc, "leaves": index_codec.columns(doc["leaves"], entries_lib.KINDS)}
  (step / "index.msgpack").write_bytes(sealed.packb(doc, use_bin_type=True))


# ---- 1. index size -----------------------------------------------------------

def nil_array(n: int) -> bytes:
  return b"\xdd" + struct.pack(">I", n) + b"\xc0" * n


def test_nil_array_index_is_refused_before_it_is_read(tmp_path):
  step = save(tmp_path)
  # 40 MiB: under the old 1 GiB limit, 320 MiB of python references decoded.
  (step / "index.msgpack").write_bytes(nil_array(40 * MiB))
  out, seconds, peak = measured(ckpt.load, tmp_path)
  assert isinstance(out, ckpt.CorruptCheckpointError), out
  assert "index.msgpack" in str(out) and "limit" in str(out), out
  assert seconds < 1 and peak < 4, (seconds, peak)


def test_index_that_is_not_a_file_is_refused(tmp_path):
  step = save(tmp_path)
  os.remove(step / "index.msgpack")
  os.mkfifo(step / "index.msgpack")  # open() would wait forever
  outcome = []
  thread = threading.Thread(target=lambda: outcome.append(
      measured(ckpt.load, tmp_path)[0]), daemon=True)
  thread.start()
  thread.join(10)
  if thread.is_alive():  # unblock the reader, then fail
    with open(step / "index.msgpack", "wb"):
      pass
    thread.join(10)
    pytest.fail("reading a FIFO index blocked")
  assert isinstance(outcome[0], ckpt.CorruptCheckpointError), outcome
  assert "regular file" in str(outcome[0])


@pytest.mark.parametrize("item", [b"\x90", b"\x81\xa0\xc0", b"\xa2ab",
                                  b"\xcd\x01\x00"])
def test_dense_index_under_the_limit_costs_little_per_byte(item):
  """Empty lists, one-entry maps, short strings, ints: the densest python
  objects per msgpack byte. Refused (not a map) in bounded memory."""
  n = (4 * MiB) // len(item)
  data = b"\xdd" + struct.pack(">I", n) + item * n
  out, seconds, peak = measured(index_lib.decode, data)
  assert isinstance(out, ckpt.CorruptCheckpointError), out
  assert peak < 32 * len(data) / MiB + 1 and seconds < 2, (seconds, peak)


def test_declared_lengths_are_checked_before_allocating():
  # A 5-byte header declaring 4 billion elements, nested: nothing allocated.
  data = (b"\xdd\xff\xff\xff\xff") * 100
  out, seconds, peak = measured(index_lib.decode, data)
  assert isinstance(out, ckpt.CorruptCheckpointError), out
  assert seconds < 0.5 and peak < 1, (seconds, peak)


def test_deep_nesting_is_refused():
  data = b"\x91" * 100_000 + b"\xc0"
  with pytest.raises(ckpt.CorruptCheckpointError):
    index_lib.decode(data)


def test_save_refuses_an_index_readers_would_refuse(monkeypatch, tmp_path):
  monkeypatch.setattr(index_lib, "MAX_INDEX_BYTES", 200)
  with pytest.raises(ckpt.CheckpointError, match="MAX_INDEX_BYTES"):
    save(tmp_path, **{f"v{i}": i for i in range(50)})


def test_real_index_decodes_within_the_budgets(tmp_path):
  """The densest honest indexes: many tiny python leaves; many 1-D
  checksummed boxes of one leaf."""
  leaves = {f"v{i}": i for i in range(3000)}
  idx = index_lib.Index(
      step=1, time=0.0, storage_format="zarr", process_count=1,
      structure=tree.encode_structure(leaves),
      leaves=tuple(entries_lib.ValueEntry(p, v) for p, v in tree.flatten(leaves)))
  assert len(index_lib.decode(index_lib.encode(idx)).leaves) == 3000
  boxes = tuple(((i,), (i + 1,), 0xFFFFFFFF) for i in range(100_000))
  entry = entries_lib.ArrayEntry(("w",), "w", (100_000,), "uint8", (1,),
                               {"compression": None}, "uint8",
                               checksums=boxes)
  idx = index_lib.Index(step=1, time=0.0, storage_format="zarr",
                        process_count=1,
                        structure=tree.encode_structure({"w": 0}),
                        leaves=(entry,))
  assert index_lib.decode(index_lib.encode(idx)).leaves[0].checksums == boxes


# ---- 2. duplicate paths --------------------------------------------------------

def leaf_list_index(names) -> bytes:
  entries = [{"path": [name], "kind": "value", "value": {"py": "int", "v": 1}}
             for name in names]
  return sealed.packb({
      "format": "ckpt", "version": 1, "step": 1, "time": 0.0,
      "storage_format": "zarr", "process_count": 1, "metrics": {},
      "structure": {"node": "none"}, "leaves": entries, "host_state": None},
      use_bin_type=True)


def test_duplicate_paths_are_reported_in_linear_time():
  """100,000 entries, 50,000 paths each twice (2.5 MB of index): the report
  costs no more than decoding as many unique entries (which then fail on
  the tree structure). Quadratic before: about 10 s more."""
  n = 100_000
  dups = leaf_list_index(f"p{i % (n // 2)}" for i in range(n))
  unique = leaf_list_index(f"p{i}" for i in range(n))
  out, seconds = timed(index_lib.decode, dups)
  assert isinstance(out, ckpt.CorruptCheckpointError), out
  assert "duplicate leaf paths" in str(out) and "'p0'" in str(out)
  other, baseline = timed(index_lib.decode, unique)
  assert "structure and leaves disagree" in str(other), other
  assert seconds < 2 * baseline + 0.5, (seconds, baseline)


# ---- 3. shapes and elements -----------------------------------------------------

@pytest.mark.parametrize("shape,chunks,fragment", [
    ([2**40, 2**21], [1, 2**21], "bytes"),       # 8 PiB of float32
    ([2**40], [1], "chunks"),                     # 2**40 chunks
    ([2**20, 2**20], [2**20, 2**20], "chunks of at most"),  # a 4 TiB chunk
    ([64, 256], [128, 256], "no larger than the shape"),
])
def test_huge_shapes_are_refused_when_the_index_is_read(tmp_path, shape,
                                                        chunks, fragment):
  step = save(tmp_path)
  doc = index_doc(step)
  entry = next(e for e in doc["leaves"] if e["kind"] == "array")
  entry.update(shape=shape, chunks=chunks, checksums=[])
  write_index(step, doc)
  out, seconds, peak = measured(ckpt.load, tmp_path)
  assert isinstance(out, ckpt.CorruptCheckpointError), out
  assert fragment in str(out) and "(w)" in str(out), out
  assert seconds < 1 and peak < 8, (seconds, peak)


def test_box_larger_than_the_host_is_refused_before_allocating(
    tmp_path, monkeypatch):
  save(tmp_path)
  monkeypatch.setattr(hostmem, "host_memory_bytes", lambda: 1000)
  with pytest.raises(ckpt.CheckpointError, match="more than this host's"):
    ckpt.load(tmp_path)


# ---- 4. array metadata the index does not vouch for ----------------------------

def write_bomb(step, fmt, shape=(64, 256)):
  """Replaces leaf w by an array of the same shape and dtype stored as ONE
  zstd chunk (of ones: a few hundred bytes on disk, all of it on a read)."""
  shutil.rmtree(step / "w")
  spec = tsspec.array_spec(fmt, {"driver": "file", "path": f"{step}/"}, "w",
                           shape, np.float32, shape, tsspec.Codec("zstd", 19))
  ts.open(spec, create=True).result().write(np.ones(shape, np.float32)
                                            ).result()


@pytest.mark.parametrize("fmt", ["zarr", "zarr3"])
def test_chunk_bomb_metadata_is_refused(tmp_path, fmt):
  step = save(tmp_path, fmt)
  assert index_doc(step)["leaves"][0]["chunks"] != [64, 256]
  write_bomb(step, fmt)
  with pytest.raises(ckpt.CorruptCheckpointError) as e:
    ckpt.load(tmp_path)
  msg = str(e.value)
  assert "leaf 'w'" in msg and "as the index describes it" in msg, msg
  assert "chunk" in msg, msg
  problems = ckpt.integrity.verify(tmp_path)
  assert [p.path for p in problems] == ["w"]


@pytest.mark.parametrize("fmt,change,fragment", [
    ("zarr", {"order": "F"}, "order"),
    ("zarr", {"filters": [{"id": "delta", "dtype": "<f4"}]}, "filters"),
    ("zarr", {"compressor": {"id": "zstd", "level": 22}}, "compressor"),
    ("zarr3", {"codecs": [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": [64, 256], "codecs": [{"name": "bytes"}],
        "index_codecs": [{"name": "bytes"}, {"name": "crc32c"}]}}]}, "codecs"),
])
def test_other_on_disk_codecs_are_refused(tmp_path, fmt, change, fragment):
  step = save(tmp_path, fmt)
  name = ".zarray" if fmt == "zarr" else "zarr.json"
  meta = json.loads((step / "w" / name).read_text())
  meta.update(change)
  (step / "w" / name).write_text(json.dumps(meta))
  with pytest.raises(ckpt.CorruptCheckpointError, match=fragment) as e:
    ckpt.load(tmp_path)
  assert "leaf 'w'" in str(e.value)


# ---- 5. OCDBT references outside the checkpoint --------------------------------

def test_ocdbt_reference_outside_the_checkpoint_cannot_escape(tmp_path):
  """The merged B+tree names data files by base_path + relative_path under
  the step's database; one rewritten to ``../../evil0/d/...`` (a valid,
  checksummed node) is refused by TensorStore before any read."""
  root = tmp_path / "root"
  step = save(root, "ocdbt")
  # Re-merge uncompressed, so the node's data-file paths are plain bytes.
  os.remove(step / "manifest.ocdbt")
  shutil.rmtree(step / "d")
  storage = storage_lib.Storage(str(root))
  base, context = storage.step_spec("checkpoint_1"), storage.context()
  parent = ts.KvStore.open({**ocdbt.database(base),
                            "config": {"compression": None}},
                           context=context).result()
  child = ts.KvStore.open(ocdbt.process_database(base, 0),
                          context=context).result()
  txn = ts.Transaction(atomic=True)
  child.experimental_copy_range_to(parent.with_transaction(txn)).result()
  txn.commit_async().result()
  assert ckpt.load(root)["w"].sum() == np.arange(64 * 256).sum()
  patched = 0
  for node in (step / "d").iterdir():
    b = bytearray(node.read_bytes())
    i = b.find(b"ocdbt.process_0/")
    if i < 0:
      continue
    b[i:i + 16] = b"../../evilproc0/"
    b[-4:] = struct.pack("<I", crc32c.crc32c(bytes(b[:-4])))
    node.write_bytes(bytes(b))
    patched += 1
  assert patched
  # The data it now names exists, outside the checkpoint.
  shutil.copytree(step / "ocdbt.process_0", tmp_path / "evilproc0")
  with pytest.raises(ckpt.CheckpointError, match="Invalid key"):
    ckpt.load(root)
  problems = ckpt.integrity.verify(root)
  assert [p.path for p in problems] == ["w"]
  assert "Invalid key" in problems[0].message


# ---- the command line applies the same bounds ----------------------------------

def test_cli_inspect_and_verify_refuse_a_hostile_index_quickly(tmp_path,
                                                               capsys):
  step = save(tmp_path)
  (step / "index.msgpack").write_bytes(nil_array(40 * MiB))
  for command in (["inspect", str(step)], ["verify", str(tmp_path)]):
    rc, seconds, peak = measured(cli.main, command)
    err = capsys.readouterr().err
    assert rc == 1, (command, rc, err)
    assert "limit" in err and seconds < 1 and peak < 4, (err, seconds, peak)


def test_cli_verify_reports_a_chunk_bomb_leaf(tmp_path, capsys):
  step = save(tmp_path)
  meta = json.loads((step / "w" / ".zarray").read_text())
  meta.update(chunks=[64, 256])
  (step / "w" / ".zarray").write_text(json.dumps(meta))
  rc = cli.main(["verify", str(tmp_path)])
  out = capsys.readouterr().out
  assert rc == 1 and "CORRUPT w" in out and "chunks" in out, out
