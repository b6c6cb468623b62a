"""Restore buffers on base pages where free huge pages go back to the
hypervisor (ckpt/restore/hostmem.py), and on numpy's huge pages elsewhere.

The page kind of a restored array is read from the kernel: the VmFlags of
the mapping that holds the array's buffer in /proc/self/smaps ("nh": advised
no huge pages, "hg": advised huge pages).
"""

import os

import jax
import numpy as np
import pytest

from ckpt.restore import hostmem
from tests.conftest import named, random_array, sharded


def _smaps_field(address: int, field: str) -> list[str]:
  """The words of ``field`` ("VmFlags:", "AnonHugePages:") of the mapping
  of this process that holds ``address`` (/proc/self/smaps)."""
  inside = False
  with open("/proc/self/smaps") as f:
    for line in f:
      head = line.split()[0]
      if "-" in head and not head.endswith(":"):
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo <= address < hi
      elif inside and line.startswith(field):
        return line.split()[1:]
  raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> set[str]:
  """The VmFlags of the mapping of this process that holds ``address``."""
  return set(_smaps_field(address, "VmFlags:"))


needs_smaps = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"),
                                 reason="reads /proc/self/smaps (Linux)")


@pytest.fixture
def huge_pages():
  saved = hostmem.HUGE_PAGES
  yield
  hostmem.HUGE_PAGES = saved


def _restore_big(make_ckptr, rng, mesh8):
  """A 32 MiB leaf whose boxes (8 MiB each) are over numpy's huge-page
  threshold; restored onto the save mesh."""
  x = random_array(rng, (2048, 4096))
  s = named(mesh8, "data", "model")
  c = make_ckptr()
  c.save(1, {"w": sharded(x, s)})
  c.wait_until_finished()
  target = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)}
  out = c.restore(1, target=target)["w"]
  np.testing.assert_array_equal(np.asarray(out), x)
  return out


@needs_smaps
def test_base_pages_when_the_hypervisor_takes_back_huge_pages(
    make_ckptr, rng, mesh8, huge_pages):
  hostmem.HUGE_PAGES = False
  out = _restore_big(make_ckptr, rng, mesh8)
  for shard in out.addressable_shards:
    ptr = shard.data.unsafe_buffer_pointer()
    for address in (ptr, ptr + shard.data.nbytes // 2,
                    ptr + shard.data.nbytes - 1):
      flags = _vm_flags(address)
      assert "nh" in flags and "hg" not in flags, (shard.index, flags)


@needs_smaps
def test_numpys_huge_pages_elsewhere(make_ckptr, rng, mesh8, huge_pages):
  if not np._core.multiarray._get_madvise_hugepage():  # pylint: disable=protected-access
    pytest.skip("numpy does not advise huge pages on this kernel")
  hostmem.HUGE_PAGES = True
  out = _restore_big(make_ckptr, rng, mesh8)
  for shard in out.addressable_shards:
    # numpy advises the whole huge pages inside its allocation: the middle.
    flags = _vm_flags(shard.data.unsafe_buffer_pointer() +
                      shard.data.nbytes // 2)
    assert "hg" in flags, (shard.index, flags)


def test_base_page_buffer_is_aligned_and_adopted_by_a_cpu_device(huge_pages):
  hostmem.HUGE_PAGES = False
  data = hostmem.aligned_empty((1024, 2048), np.float32, 64)
  assert data.ctypes.data % 64 == 0 and data.flags.writeable
  data[...] = np.arange(data.size, dtype=np.float32).reshape(data.shape)
  a = jax.device_put(data, jax.devices()[0])
  assert a.unsafe_buffer_pointer() == data.ctypes.data  # no copy
  np.testing.assert_array_equal(np.asarray(a), data)
  small = hostmem.aligned_empty((3, 5), np.int16, 64)  # numpy's allocator
  assert small.shape == (3, 5) and small.ctypes.data % 64 == 0


def _sysfs(root, features: str | None, order: str | None):
  if features is not None:
    d = root / "bus/virtio/drivers/virtio_balloon/virtio0"
    d.mkdir(parents=True)
    (d / "features").write_text(features + "\n")
  if order is not None:
    d = root / "module/page_reporting/parameters"
    d.mkdir(parents=True)
    (d / "page_reporting_order").write_text(order + "\n")
  return str(root)


REPORTING = "0110010100000000000000000000000010000000"  # bit 5 set
NO_REPORTING = "0110000100000000000000000000000010000000"


@pytest.mark.parametrize("features,order,expected", [
    (REPORTING, "9", True),
    (REPORTING, None, True),  # the kernel's default order: a huge page's
    (REPORTING, "10", False),  # only 4 MiB blocks: a huge page stays
    (NO_REPORTING, "9", False),
    (None, None, False),  # no balloon device: bare metal or another VM
    ("01", "9", False),  # too short to hold bit 5
])
def test_reports_huge_pages(tmp_path, features, order, expected):
  assert hostmem.reports_huge_pages(_sysfs(tmp_path, features, order)) is (
      expected)


def test_auto_follows_the_machine(huge_pages):
  hostmem.HUGE_PAGES = None
  assert hostmem.use_huge_pages() is (not hostmem.reports_huge_pages())
  hostmem.HUGE_PAGES = True
  assert hostmem.use_huge_pages()
  hostmem.HUGE_PAGES = False
  assert not hostmem.use_huge_pages()


def _thp_enabled() -> bool:
  try:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      return "[never]" not in f.read()
  except OSError:
    return False


class _Clock:
  """A thread clock whose probes cost ``cost_s`` each."""

  def __init__(self, cost_s: float):
    self.cost_s, self.now = cost_s, 0.0

  def __call__(self) -> float:
    self.now += self.cost_s / 2
    return self.now


def _address(allocated) -> int:
  m, offset = allocated
  view = np.frombuffer(m, np.uint8)
  return view.ctypes.data + offset


def _anon_huge_kb(address: int) -> int:
  """AnonHugePages of the mapping that holds ``address`` (kB)."""
  return int(_smaps_field(address, "AnonHugePages:")[0])


@needs_smaps
def test_a_cheap_probe_keeps_huge_pages_for_the_whole_buffer():
  chooser = hostmem._Chooser(_Clock(0.0))  # pylint: disable=protected-access
  allocated = chooser.allocate((4 << 20) + 4096)  # a 4 MiB box and its slack
  base = _address(allocated)
  assert base % (2 << 20) == 0  # on a huge page's boundary
  for offset in (0, 2 << 20, 4 << 20):
    assert "hg" in _vm_flags(base + offset), offset
  assert (chooser.probes, chooser.slow) == (1, 0)
  assert chooser.huge_bytes == (4 << 20) + 4096 and chooser.base_bytes == 0
  # Written whole, the 4 MiB are two huge pages where the kernel has them.
  view = np.frombuffer(allocated[0], np.uint8)[allocated[1]:]
  view[:4 << 20:4096] = 1
  if _thp_enabled():
    assert _anon_huge_kb(base) >= 4096


@needs_smaps
def test_a_slow_probe_gives_base_pages_to_the_rest_and_the_next_buffers(
    monkeypatch):
  monkeypatch.setattr(hostmem, "BASE_BYTES", 24 << 20)
  chooser = hostmem._Chooser(  # pylint: disable=protected-access
      _Clock(10 * hostmem.SLOW_HUGE_FAULT_S))
  first = chooser.allocate(16 << 20)
  probed = _address(first)  # the huge page the probe touched
  assert probed % (2 << 20) == 0
  assert "hg" in _vm_flags(probed)
  assert "nh" in _vm_flags(probed + (2 << 20))
  assert "nh" in _vm_flags(probed + (16 << 20) - 1)
  assert (chooser.probes, chooser.slow) == (1, 1)
  # The next 24 MiB of buffers: base pages, no probe.
  for _ in range(3):
    m = chooser.allocate(8 << 20)
    assert "nh" in _vm_flags(_address(m))
  assert chooser.probes == 1
  chooser.allocate(8 << 20)  # then a probe again
  assert (chooser.probes, chooser.slow) == (2, 2)


def test_auto_probes_buffers_on_a_reporting_machine(huge_pages, monkeypatch):
  """HUGE_PAGES None on a machine that reports: every large buffer goes
  through the probe; its bytes are written and read back intact."""
  hostmem.HUGE_PAGES = None
  monkeypatch.setattr(hostmem, "_machine_reports_huge_pages", lambda: True)
  chooser = hostmem._Chooser()  # pylint: disable=protected-access
  monkeypatch.setattr(hostmem, "CHOOSER", chooser)
  data = hostmem.aligned_empty((1024, 2048), np.float32, 64)
  data[...] = 1.5
  assert chooser.probes + chooser.base_bytes // (8 << 20) >= 1
  assert chooser.huge_bytes + chooser.base_bytes >= data.nbytes
  np.testing.assert_array_equal(data, np.full((1024, 2048), 1.5, np.float32))
