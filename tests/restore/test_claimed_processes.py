"""An index that claims far more saving processes than its step holds files
of is refused (or fallen back past) before any per-process work
(ckpt/restore/listed.py).

``process_count`` = 2**20 is legal by the format's bounds: a 6-byte edit of
a sealed index (sealed again: tests/sealed.py). Before, the checksum reader
of format "zarr" made a coroutine per claimed process before the first
missing file stopped it (78-116 s and 2.7 GiB per restoring process; ``ckpt
verify`` 91-123 s), and the pack reader read a table per claimed process.
Bounded here: the CPU seconds of this process, and the growth of its
resident memory (sampled from a thread while the call runs) over what it
held before.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import psutil
import pytest

import ckpt
from ckpt.format import index as index_lib
from tests import sealed

MiB = 1 << 20
CPU_S = 1.0
RSS_MIB = 400
N = 16384


class Peak:
  """The largest resident size of this process while it is entered,
  sampled every 5 ms, over what it held when entered."""

  def __enter__(self) -> "Peak":
    self._proc = psutil.Process()
    self.base = self.peak = self._proc.memory_info().rss
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def _sample(self) -> None:
    while not self._stop.wait(0.005):
      self.peak = max(self.peak, self._proc.memory_info().rss)

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, self._proc.memory_info().rss)

  @property
  def growth_mib(self) -> float:
    return (self.peak - self.base) / MiB


def bounded(fn, *args, **kwargs):
  """(what ``fn`` returned or raised, CPU seconds, RSS growth in MiB)."""
  t0 = time.process_time()
  with Peak() as peak:
    try:
      out = fn(*args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      out = e
  return out, time.process_time() - t0, peak.growth_mib


def save(root, packed: bool, steps=(1, 2)):
  """Steps of one leaf ``w`` (arange + step): packed (each process's table
  and packs), or (pack.MAX_LEAF_BYTES = 0) a TensorStore array of format
  "zarr" with its per-process checksum files."""
  from ckpt.save import pack  # pylint: disable=g-import-not-at-top
  kept = pack.MAX_LEAF_BYTES
  pack.MAX_LEAF_BYTES = kept if packed else 0
  try:
    with ckpt.Checkpointer(root, async_save=False, format="zarr",
                           chunk_bytes=4096) as c:
      for s in steps:
        c.save(s, {"w": np.arange(N, dtype=np.float32) + s})
  finally:
    pack.MAX_LEAF_BYTES = kept
  return root


def claim(step_dir, count: int = index_lib.MAX_PROCESSES) -> None:
  """The step's index, edited to say ``count`` processes saved it, sealed
  again (a 6-byte edit of the document)."""
  path = step_dir / "index.msgpack"
  doc = sealed.unpackb(path.read_bytes(), raw=False)
  assert doc["process_count"] == 1
  doc["process_count"] = count
  path.write_bytes(sealed.packb(doc, use_bin_type=True))


def check(got, seconds: float, growth: float, *fragments: str) -> None:
  assert isinstance(got, ckpt.CorruptCheckpointError), got
  for f in fragments:
    assert f in str(got), (f, got)
  assert seconds < CPU_S and growth < RSS_MIB, (seconds, growth, got)


@pytest.mark.parametrize("packed", [False, True])
def test_an_explicit_restore_is_refused_quickly(tmp_path, packed):
  root = save(tmp_path / "ck", packed)
  ckpt.load(root, 2)  # warm: imports, the TensorStore context
  claim(root / "checkpoint_2")
  with ckpt.Checkpointer(root, async_save=False) as c:
    got, seconds, growth = bounded(c.restore, 2)
  print(f"packed={packed}: {seconds:.2f} s CPU, +{growth:.0f} MiB: {got}")
  if packed:
    # A process with no packed box writes no table: the one table there
    # is tiles the leaf, so the claim costs nothing and the data is exact.
    np.testing.assert_array_equal(got["w"], np.arange(N) + 2)
    assert seconds < CPU_S and growth < RSS_MIB, (seconds, growth)
  else:
    check(got, seconds, growth, "checksum file of process 1",
          f"the index says {index_lib.MAX_PROCESSES} processes",
          "holds the files of 1")


def test_a_resume_falls_back_past_it_quickly(tmp_path):
  root = save(tmp_path / "ck", packed=False)
  ckpt.load(root, 1)
  claim(root / "checkpoint_2")
  with ckpt.Checkpointer(root, async_save=False) as c:
    got, seconds, growth = bounded(c.restore)
    assert c.last_restore_step == 1
  np.testing.assert_array_equal(got["w"], np.arange(N) + 1)
  assert seconds < CPU_S and growth < RSS_MIB, (seconds, growth)


def test_verify_reports_it_quickly(tmp_path):
  root = save(tmp_path / "ck", packed=False, steps=(1,))
  ckpt.integrity.verify(root)  # warm
  claim(root / "checkpoint_1")
  problems, seconds, growth = bounded(ckpt.integrity.verify, root)
  assert [p.path for p in problems] == ["w"], problems
  assert "checksum file of process 1" in problems[0].message, problems
  assert seconds < CPU_S and growth < RSS_MIB, (seconds, growth)


def test_inspect_reads_only_the_files_there_are(tmp_path, capsys):
  """``ckpt inspect`` reads the ``.reuse`` files the step holds (one
  listing), not one per claimed process (before: 9.5 s CPU)."""
  from ckpt.cli import main as cli  # pylint: disable=g-import-not-at-top
  root = save(tmp_path / "ck", packed=False, steps=(1,))
  cli.main(["inspect", str(root / "checkpoint_1")])  # warm
  claim(root / "checkpoint_1")
  rc, seconds, growth = bounded(cli.main,
                                ["inspect", str(root / "checkpoint_1")])
  out = capsys.readouterr().out
  assert rc == 0 and "(16384,)" in out, (rc, out)
  assert seconds < CPU_S and growth < RSS_MIB, (seconds, growth)


def test_a_step_that_holds_every_claimed_file_still_restores(tmp_path):
  """The listing takes what is there: an index claiming the processes
  whose files exist (here the one) restores as before."""
  root = save(tmp_path / "ck", packed=False, steps=(1,))
  claim(root / "checkpoint_1", 1)
  np.testing.assert_array_equal(ckpt.load(root, 1)["w"],
                                np.arange(N) + 1)
