"""A freed restore buffer's memory serves the next restore
(ckpt/restore/hostpool.py), bounded and given back when idle; and a
restored tree goes as soon as the caller drops it (no reference cycle
holding it until the next garbage collection)."""

from __future__ import annotations

import gc
import mmap
import resource
import weakref

import jax
import numpy as np
import pytest

from ckpt.restore import hostmem
from ckpt.restore import hostpool
from tests.conftest import named, random_array, sharded


@pytest.fixture
def base_pages():
  """Buffers on mappings of their own (as on a VM that reports free huge
  pages), whatever this machine is."""
  saved = hostmem.HUGE_PAGES
  hostmem.HUGE_PAGES = False
  yield
  hostmem.HUGE_PAGES = saved


def _minor_faults() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _saved(make_ckptr, rng, mesh8, shape):
  """A Checkpointer holding step 1, one random leaf sharded data x model,
  with the leaf and the restore target onto the same sharding."""
  x = random_array(rng, shape)
  s = named(mesh8, "data", "model")
  c = make_ckptr()
  c.save(1, {"w": sharded(x, s)})
  c.wait_until_finished()
  return c, x, {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)}


def test_a_restore_after_a_freed_one_faults_almost_nothing(
    make_ckptr, rng, mesh8, base_pages):
  """A restore whose previous result was freed reads into that memory:
  its pages are resident (before, each buffer was a fresh mapping, faulted
  in page by page: 8,192 faults for these 32 MiB)."""
  c, x, target = _saved(make_ckptr, rng, mesh8, (2048, 4096))
  out = c.restore(1, target=target)
  del out
  # jax releases the host memory a CPU device adopted at a collection.
  gc.collect()
  before = _minor_faults()
  out = c.restore(1, target=target)
  faults = _minor_faults() - before
  np.testing.assert_array_equal(np.asarray(out["w"]), x)
  assert faults < x.nbytes // mmap.PAGESIZE // 8, faults


def test_kept_memory_is_bounded_and_given_back_when_idle(monkeypatch):
  """At most MAX_BYTES are kept; a mapping unused for IDLE_S is dropped."""
  now = [0.0]
  pool = hostpool.Pool(lambda: 1 << 40, clock=lambda: now[0])
  monkeypatch.setattr(hostpool, "MAX_BYTES", 3 * mmap.PAGESIZE)
  size = mmap.PAGESIZE

  def freed():
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = pool.adopt(np.frombuffer(m, np.uint8), m, 0, size)
    del view, m

  for _ in range(5):
    freed()
  assert pool.kept_bytes == 3 * size  # the other two were unmapped
  now[0] = 5.0
  freed()  # over the bound still
  assert pool.kept_bytes == 3 * size
  assert pool.take(size) is not None
  freed()  # freed at 5 s
  pool.trim(older_than=4.0)
  assert pool.kept_bytes == size  # the one freed at 5 s stays
  now[0] = 20.0
  pool.trim(older_than=4.0)
  assert pool.kept_bytes == 0
  assert pool.take(size) is None


def test_off_when_max_bytes_is_zero(monkeypatch):
  monkeypatch.setattr(hostpool, "MAX_BYTES", 0)
  pool = hostpool.Pool(lambda: 1 << 40)
  m = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  view = pool.adopt(np.frombuffer(m, np.uint8), m, 0, mmap.PAGESIZE)
  del view, m
  assert pool.kept_bytes == 0


def test_a_restored_tree_goes_when_dropped(make_ckptr, rng, mesh8):
  """No reference cycle holds a restored tree after the caller drops it
  (before, restore_async's handle closures held it until a full garbage
  collection: the memory of a whole state, for seconds)."""
  c, x, target = _saved(make_ckptr, rng, mesh8, (64, 128))
  gc.collect()
  gc.disable()
  try:
    for restore in (lambda: c.restore(1, target=target),
                    lambda: c.restore_async(1, target=target).result()):
      out = restore()
      ref = weakref.ref(out["w"])
      del out
      assert ref() is None
  finally:
    gc.enable()
