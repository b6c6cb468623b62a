"""Fuzzing the index decoder: a checkpoint from a shared bucket is untrusted.

Mutated indexes (flipped and cut bytes, and structurally valid msgpack with
hostile values: absolute or '..' paths, huge shapes, wrong types) must either
decode to an Index whose every path stays inside the step directory, or raise
CorruptCheckpointError; restoring from them raises only CheckpointError, and
nothing outside the checkpoint is read or written.
"""

import os
import time
import tracemalloc

from hypothesis import HealthCheck, assume, given, settings, strategies as st
import msgpack
from tests import sealed
import numpy as np
import pytest

import ckpt
from ckpt.format import index as index_lib
from ckpt.format import index_codec
from ckpt.format import entries


@pytest.fixture(scope="module", autouse=True)
def _arrays_only(arrays_only):
  """Small test arrays stay TensorStore arrays (tests/save/test_pack.py covers
  packed leaves)."""
  del arrays_only


SETTINGS = dict(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  root = tmp_path_factory.mktemp("fuzz") / "ckpts"
  rng = np.random.default_rng(0)
  state = {"params": {"w": rng.standard_normal((32, 16)).astype(np.float32),
                      "b": rng.standard_normal((300,)).astype(np.float32)},
           "step": 7, "name": "run", "opt": (np.int32(3), None, {})}
  with ckpt.Checkpointer(root, async_save=False, chunk_bytes=512) as c:
    c.save(1, state)
  data = (root / "checkpoint_1" / "index.msgpack").read_bytes()
  return root, data


def _check_decoded(idx: index_lib.Index):
  for e in idx.leaves:
    if isinstance(e, entries.ArrayEntry):
      base = os.path.realpath("/ckpt/step")
      full = os.path.realpath(os.path.join(base, e.relpath))
      assert full.startswith(base + os.sep), e.relpath


def _decode(data: bytes):
  try:
    idx = index_lib.decode(data)
  except ckpt.CorruptCheckpointError:
    return None
  _check_decoded(idx)
  return idx


@settings(**SETTINGS)
@given(st.data())
def test_byte_mutations(saved, data):
  _, good = saved
  buf = bytearray(good)
  for _ in range(data.draw(st.integers(1, 8))):
    i = data.draw(st.integers(0, len(buf) - 1))
    buf[i] = data.draw(st.integers(0, 255))
  if data.draw(st.booleans()):
    buf = buf[:data.draw(st.integers(0, len(buf)))]
  _decode(bytes(buf))


HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
    st.text(max_size=20), st.binary(max_size=20),
    st.sampled_from(["/etc/passwd", "../../x", "..", "a/../../b", "/", "",
                     "a//b", "./a", "a\\..\\b", "%2e%2e", "float32", "zarr"]),
    st.lists(st.integers(-5, 2**62), max_size=4),
    st.lists(st.integers(0, 8), max_size=70),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))


def _paths(doc, prefix=()):
  """Every (container, key) location in a decoded msgpack document."""
  if isinstance(doc, dict):
    for k, v in doc.items():
      yield doc, k
      yield from _paths(v)
  elif isinstance(doc, list):
    for i, v in enumerate(doc):
      yield doc, i
      yield from _paths(v)


@settings(**SETTINGS)
@given(st.data())
def test_structural_mutations(saved, data):
  _, good = saved
  doc = sealed.unpackb(good, raw=False, strict_map_key=False)
  for _ in range(data.draw(st.integers(1, 4))):
    spots = list(_paths(doc))
    container, key = spots[data.draw(st.integers(0, len(spots) - 1))]
    container[key] = data.draw(HOSTILE)
  try:
    packed = sealed.packb(doc, use_bin_type=True)
  except (OverflowError, ValueError, TypeError):
    assume(False)  # not representable in msgpack: no index can hold it
  _decode(packed)


@settings(**SETTINGS)
@given(st.data())
def test_structural_mutations_of_leaf_maps(saved, data):
  """Hostile values in any field of any leaf, as version 1's maps written
  back as today's columns: each lands in a spec (checked once) or in a
  per-leaf column (checked per leaf)."""
  _, good = saved
  doc = sealed.unpackb(good, raw=False, strict_map_key=False)
  doc["leaves"] = index_codec.rows(doc["leaves"])
  for _ in range(data.draw(st.integers(1, 4))):
    spots = list(_paths(doc["leaves"]))
    container, key = spots[data.draw(st.integers(0, len(spots) - 1))]
    container[key] = data.draw(HOSTILE)
  try:
    doc["leaves"] = index_codec.columns(doc["leaves"], entries.KINDS)
    packed = sealed.packb(doc, use_bin_type=True)
  except (OverflowError, ValueError, TypeError):
    assume(False)
  _decode(packed)


@settings(**{**SETTINGS, "max_examples": 40})
@given(st.data())
def test_restoring_a_hostile_index_raises_only_checkpoint_errors(saved, data):
  root, good = saved
  doc = sealed.unpackb(good, raw=False, strict_map_key=False)
  doc["leaves"] = index_codec.rows(doc["leaves"])  # edited as leaf maps
  array = next(e for e in doc["leaves"] if e["kind"] == "array")
  field = data.draw(st.sampled_from(["relpath", "shape", "dtype", "chunks",
                                     "checksums", "codec", "path"]))
  array[field] = data.draw(HOSTILE)
  victim = root.parent / "outside.bin"
  victim.write_bytes(b"do not touch")
  before = sorted(p.name for p in root.parent.iterdir())
  step = root / "checkpoint_1"
  original = (step / "index.msgpack").read_bytes()
  try:
    try:
      doc["leaves"] = index_codec.columns(doc["leaves"], entries.KINDS)
      packed = sealed.packb(doc, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
      assume(False)
    (step / "index.msgpack").write_bytes(packed)
    try:
      ckpt.load(root)
    except ckpt.CheckpointError:
      pass
    try:
      ckpt.integrity.verify(root)
    except ckpt.CheckpointError:
      pass
  finally:
    (step / "index.msgpack").write_bytes(original)
  assert victim.read_bytes() == b"do not touch"
  assert sorted(p.name for p in root.parent.iterdir()) == before


# Pieces that make a decoder allocate: container headers declaring up to 4
# billion elements, runs of empty containers, one-entry maps, short strings,
# nils; spliced anywhere into a real index.
BLOWUPS = st.one_of(
    st.sampled_from([b"\xdc\xff\xff", b"\xdd\xff\xff\xff\xff",
                     b"\xde\xff\xff", b"\xdf\xff\xff\xff\xff",
                     b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"]),
    st.builds(lambda item, n: b"\xdd" + n.to_bytes(4, "big") + item * n,
              st.sampled_from([b"\xc0", b"\x90", b"\x80", b"\x81\xa0\xc0",
                               b"\xa2ab", b"\x91\x90"]),
              st.integers(0, 1 << 18)),
    st.builds(lambda k: b"\x91" * k, st.integers(0, 5000)))


@settings(**{**SETTINGS, "max_examples": 60})
@given(st.data())
def test_each_decode_is_bounded_in_time_and_memory(saved, data):
  """Not only the exception type: every mutated index decodes (or is
  refused) in under 1 s and 100 MiB of python allocations."""
  _, good = saved
  buf = bytearray(good)
  for _ in range(data.draw(st.integers(1, 3))):
    i = data.draw(st.integers(0, len(buf)))
    cut = data.draw(st.integers(0, 8))
    buf[i:i + cut] = data.draw(BLOWUPS)
  tracemalloc.start()
  t0 = time.perf_counter()
  try:
    _decode(bytes(buf))
  finally:
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
  assert seconds < 1 and peak < 100 << 20, (seconds, peak, len(buf))
