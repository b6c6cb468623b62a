"""Unit tests of the local tier (ckpt/tiers/local_tier.py, ckpt/tiers/local_manifest.py,
ckpt/tiers/partner.py) that
need no multi-process job."""

import pytest

import ckpt
from ckpt.tiers import partner


def test_partner_is_another_process_and_another_slice():
  assert partner.partner_of(1, [0]) == [0]
  assert partner.partner_of(4, [0] * 4) == [1, 2, 3, 0]
  dst = partner.partner_of(4, [0, 0, 1, 1])
  assert dst == [2, 3, 0, 1]
  assert all(p != q for p, q in enumerate(partner.partner_of(5, [0] * 5)))


def test_local_keep_must_be_two_or_more(tmp_path):
  with pytest.raises(ValueError, match="local_keep"):
    ckpt.MultiTierCheckpointer(str(tmp_path / "p"), local=str(tmp_path / "l"),
                               local_keep=1)


def test_a_failed_local_save_drains_within_the_budget(tmpfs, tmp_path):
  """The local disk fills up during a local save (a real 1 MiB tmpfs); the
  writer then drains slowly. The caller must stage nothing more once the
  save has failed: host memory held stays within concurrent_bytes."""
  import time  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  budget = 1 << 20
  mesh = Mesh(np.array(jax.devices()), ("x",))
  rng = np.random.default_rng(6)
  state = {f"w{i}": jax.device_put(  # 2 MiB a leaf, 256 KiB a shard
      rng.standard_normal((8 * 256, 256), np.float32),
      NamedSharding(mesh, P("x"))) for i in range(8)}
  mt = ckpt.MultiTierCheckpointer(str(tmp_path / "p"), local=str(tmpfs("1m")),
                                  concurrent_bytes=budget)
  try:
    release = mt.local.budget.release

    def slow_release(n):  # a slow drain: the writer gives bytes back late
      time.sleep(0.02)
      release(n)
    mt.local.budget.release = slow_release
    with pytest.raises((ckpt.CheckpointError, OSError), match="space"):
      mt.save(1, state)
      mt.wait_until_finished()
    assert 0 < mt.local.budget.peak <= budget, mt.local.budget.peak
    assert mt.local.budget.used == 0
  finally:
    mt.local.budget.release = release
    mt.close()


def test_check_manifest_rejects_what_is_not_a_manifest():
  """Every field is checked before use (issue 23 item 8): a clean
  CorruptCheckpointError naming the file and field, never a KeyError."""
  from ckpt.tiers import local_manifest  # pylint: disable=g-import-not-at-top
  good = {"format": local_manifest.FORMAT, "version": local_manifest.VERSION,
          "step": 3, "process": 0, "process_count": 2, "local_devices": 1,
          "partner_src": 1, "owner": "file:///p", "host_names": [],
          "files": {"own.bin": 16, "partner.bin": 0, "host.msgpack": 9},
          "crc32c": {"host.msgpack": 7},
          "own": {"w": {"shape": [4], "dtype": "<f4", "slots": [0],
                        "shards": [[[[0, 4]], 0, 16, [4], 123]]}},
          "partner": {}}
  local_manifest.check_manifest(good, 3, 0, "m.json")
  bad = [[], {}, {**good, "step": 4}, {**good, "process_count": "2"},
         {**good, "files": {"own.bin": 8, "partner.bin": 0,
                            "host.msgpack": 9}},     # shard past the file end
         {**good, "own": {"w": {**good["own"]["w"], "dtype": "|O"}}},
         {**good, "own": {"w": {**good["own"]["w"], "slots": [1]}}}]
  for m in bad:
    with pytest.raises(ckpt.CheckpointError, match="m.json"):
      local_manifest.check_manifest(m, 3, 0, "m.json")
