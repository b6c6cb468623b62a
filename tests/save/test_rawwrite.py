"""Raw chunk files written from the box's memory (ckpt/save/rawwrite.py):
byte for byte what TensorStore writes, each fsynced once, and a write that
fails or a process that dies mid-write never commits (8 CPU devices, a real
disk, a real TensorStore for the comparison)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import ckpt
from ckpt.save import rawwrite
from tests.conftest import named, random_array, sharded

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


@pytest.fixture(scope="module", autouse=True)
def _arrays_only(arrays_only):
  del arrays_only


def _files(step_dir) -> dict[str, bytes]:
  """Every file of the arrays' folders of a committed step (chunks and
  metadata), by its path inside the step."""
  out = {}
  for d, _, names in os.walk(step_dir):
    rel = os.path.relpath(d, step_dir)
    if rel.split(os.sep)[0] in (".", ".checksums", ".host_state"):
      continue
    for n in names:
      with open(os.path.join(d, n), "rb") as f:
        out[os.path.join(rel, n)] = f.read()
  return out


def _state(rng, mesh8):
  return {
      # one chunk per box, 4 boxes over "model"
      "w": sharded(random_array(rng, (512, 256)), named(mesh8, "model", None)),
      # boxes split both ways
      "m": sharded(random_array(rng, (256, 512)), named(mesh8, "data", "model")),
      "bf": sharded(random_array(rng, (128, 256), ml_dtypes.bfloat16),
                    named(mesh8, None, "model")),
      "i8": sharded(random_array(rng, (64, 1024), np.int8),
                    named(mesh8, "data", None)),
      "b": sharded(random_array(rng, (256, 256), np.bool_),
                   named(mesh8, "model", None)),
      "c": sharded(random_array(rng, (128, 128), np.complex64),
                   named(mesh8, "model", None)),
      "host": random_array(rng, (300, 70)),  # a host numpy leaf
      # an edge chunk (the shape is not a multiple of the chunk): TensorStore
      "edge": random_array(rng, (1000, 333)),
      "s": np.int32(7),
  }


@pytest.fixture
def counted_writes(monkeypatch):
  """The chunk files written raw, as a list that grows."""
  written = []
  real = rawwrite._write_file  # pylint: disable=protected-access

  def counting(path, view, drop):
    written.append(path)
    return real(path, view, drop)
  monkeypatch.setattr(rawwrite, "_write_file", counting)
  return written


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 16 << 10])
@pytest.mark.parametrize("async_save", [False, True])
def test_raw_chunk_files_are_byte_identical_to_tensorstores(
    make_ckptr, tmp_path, rng, mesh8, monkeypatch, counted_writes,
    chunk_bytes, async_save):
  state = _state(rng, mesh8)
  got = {}
  for raw in (True, False):
    monkeypatch.setattr(rawwrite, "RAW_WRITES", raw)
    before = len(counted_writes)
    c = make_ckptr(tmp_path / f"raw{raw}", async_save=async_save,
                   chunk_bytes=chunk_bytes)
    c.save(1, state)
    c.wait_until_finished()
    got[raw] = _files(tmp_path / f"raw{raw}" / "checkpoint_1")
    back = c.restore(1)
    for k in ("w", "m", "bf", "i8", "b", "c", "host", "edge"):
      np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(state[k]))
    if raw:  # every chunk of every leaf but the edge one's boxes: raw
      assert len(counted_writes) - before >= 6 * 4, counted_writes
    else:
      assert len(counted_writes) == before
  assert sorted(got[True]) == sorted(got[False])
  assert not [p for p in got[True] if "__lock" in p or ".partial" in p]
  differ = [p for p in got[False] if got[True][p] != got[False][p]]
  assert not differ, differ
  chunks = [p for p in got[True] if not os.path.basename(p).startswith(".z")]
  assert len(chunks) > 20, sorted(got[True])


def test_a_failed_write_fails_the_save_and_commits_nothing(
    make_ckptr, ckpt_dir, rng, mesh8, monkeypatch):
  c = make_ckptr(async_save=False)
  first = _state(rng, mesh8)
  c.save(1, first)
  calls = []

  def failing(fd):
    calls.append(fd)
    raise OSError(5, "Input/output error (injected)")
  monkeypatch.setattr(rawwrite, "sync", failing)
  with pytest.raises(ckpt.CheckpointError, match="writing") as e:
    c.save(2, _state(rng, mesh8))
  assert calls and "injected" in str(e.value)
  monkeypatch.undo()
  assert c.all_steps() == [1]
  assert not [p for p in os.listdir(ckpt_dir) if p.startswith("checkpoint_2")]
  third = _state(rng, mesh8)
  assert c.save(3, third)
  assert c.all_steps() == [1, 3]
  for step, want in ((1, first), (3, third)):
    back = c.restore(step)
    for k in ("w", "m", "edge"):
      np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(want[k]))


_CRASH = textwrap.dedent("""
    import os, signal, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import ckpt
    from ckpt.save import pack, rawwrite
    pack.MAX_LEAF_BYTES = 0
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("x",))
    def state(seed):
      rng = np.random.default_rng(seed)
      return {f"a{i}": jax.device_put(
          rng.standard_normal((1024, 512), np.float32),
          NamedSharding(mesh, P("x"))) for i in range(4)}
    with ckpt.Checkpointer(sys.argv[1], async_save=False) as c:
      c.save(1, state(1))
      real = os.pwritev
      def half_then_die(fd, buffers, offset):
        n = real(fd, [memoryview(buffers[0])[:len(buffers[0]) // 2]], offset)
        os.kill(os.getpid(), signal.SIGKILL)  # dies mid-write
      rawwrite.os.pwritev = half_then_die
      c.save(2, state(2))
""")


def test_a_process_killed_mid_write_never_commits(tmp_path, rng):
  root = tmp_path / "root"
  script = tmp_path / "crash.py"
  script.write_text(_CRASH)
  r = subprocess.run([sys.executable, str(script), str(root)], timeout=300,
                     cwd=_REPO, env={**os.environ, "PYTHONPATH": _REPO},
                     capture_output=True, text=True, check=False)
  assert r.returncode == -9, r.stderr[-3000:]
  [attempt] = [p for p in os.listdir(root) if ".tmp-" in p]
  short = [os.path.join(d, n) for d, _, ns in os.walk(root / attempt)
           for n in ns if not n.startswith(".z")
           and os.path.getsize(os.path.join(d, n)) == 1024 * 512 * 4 // 16]
  assert short, "the process did not die in the middle of a chunk file"
  with ckpt.Checkpointer(root, async_save=False) as c:
    assert c.all_steps() == [1]
    back = c.restore(1)
    want = np.random.default_rng(1).standard_normal((1024, 512), np.float32)
    np.testing.assert_array_equal(np.asarray(back["a0"]), want)
    state = {"w": random_array(rng, (512, 256))}
    assert c.save(2, state)
    assert c.all_steps() == [1, 2]
    np.testing.assert_array_equal(np.asarray(c.restore(2)["w"]), state["w"])


@pytest.mark.parametrize("cut", [
    (slice(None), slice(0, 20000)),  # rows of 80,000 bytes, strided: by run
    (slice(0, 8), slice(100, 300)),  # short runs: copied out whole
    (slice(3, 11), slice(None)),  # contiguous
])
def test_a_chunk_file_is_its_bytes_in_c_order_and_their_crc32c(
    tmp_path, rng, monkeypatch, cut):
  import crc32c  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(rawwrite, "PIECE_BYTES", 1 << 16)  # several pieces
  box = random_array(rng, (16, 40000))
  view = box[cut]
  path = str(tmp_path / "0.0")
  crc = rawwrite._write_file(path, view, False)  # pylint: disable=protected-access
  want = np.ascontiguousarray(view).tobytes()
  with open(path, "rb") as f:
    assert f.read() == want
  assert crc == crc32c.crc32c(want)


def test_reuse_writes_changed_boxes_raw_and_links_the_rest(
    make_ckptr, tmp_path, rng, mesh8, counted_writes):
  """``reuse_unchanged=True``: a box that changed (or is new) is written as
  raw chunk files like without reuse, its crc32c records the ones taken as
  it was written (a verified restore checks them); an unchanged one is
  linked, not written. Was: every changed box went through TensorStore."""
  frozen = _state(rng, mesh8)
  c = make_ckptr(tmp_path / "r", async_save=False, reuse_unchanged=True,
                 keep=4)
  raw_leaves = ("w", "m", "bf", "i8", "b", "c")  # the edge leaf is not raw
  saved = {}
  for step in (1, 2, 3, 4):  # 1, 2: two copies; 3: one leaf changes; 4: all
    state = dict(frozen)
    if step == 3:
      state["w"] = sharded(random_array(rng, (512, 256)),
                           named(mesh8, "model", None))
    if step == 4:
      state = _state(rng, mesh8)
    before = len(counted_writes)
    c.save(step, state)
    wrote = {p.split(os.sep)[-2] for p in counted_writes[before:]}
    if step in (1, 2, 4):  # everything written (nothing to link from)
      assert wrote >= set(raw_leaves), (step, sorted(wrote))
    else:  # only the changed leaf; the others linked from step 1
      assert wrote == {"w"}, sorted(wrote)
      assert c.last_save_stats.chunks_reused > 0
    saved[step] = state
  for step, want in saved.items():
    back = c.restore(step, verify=True)
    for k in raw_leaves + ("host", "edge"):
      np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(want[k]))
