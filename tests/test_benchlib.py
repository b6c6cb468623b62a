"""scripts/benchlib: its one measure(), the limit and the plain-file systems,
in this process (8 CPU devices, tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

from scripts.benchlib import measure
from scripts.benchlib import presets
from scripts.benchlib import systems


def test_measure_sees_time_cpu_and_touched_memory():
  with measure.measure() as m:
    buf = np.ones(64 << 20, np.uint8)  # touched: 64 MiB resident
    sum(range(200_000))
  del buf
  assert m.wall_s > 0 and m.cpu_s > 0 and m.minor_faults > 0
  assert m.extra_rss >= 48 << 20, m.figures()
  assert m.lap() >= m.wall_s


def test_the_limit_is_the_shared_file_and_restores_bit_exact(tmp_path):
  preset = presets.load_preset("smoke")
  topo = presets.Topology(preset)
  state = presets.build_state(preset, topo)
  system = systems.make_system("limit", preset)
  # Loaded by path from ../shared/limits/limits.py, not a copy.
  assert system.limits.__file__ == str(systems.LIMITS)
  assert systems.LIMITS.parent.parent.name == "shared"
  system.save(str(tmp_path / "ck"), state)
  assert system.restores_onto("same") and not system.restores_onto("other")
  got = system.restore(str(tmp_path / "ck"),
                       presets.abstract_state(preset, topo.save_mesh))
  assert presets.verify(preset, got) > 0
  # One file per distinct shard: 8 + 1 + 4 (w0, w1: 8 each).
  assert len(list((tmp_path / "ck" / "p0").iterdir())) == 8 + 8 + 1 + 4


def test_the_benchmark_offers_the_limit_not_the_old_baselines():
  assert systems.SYSTEMS == ("ckpt", "orbax", "limit")
  with pytest.raises(ValueError, match="unknown system 'raw'"):
    systems.make_system("raw", presets.load_preset("smoke"))


@pytest.mark.parametrize("cls", [systems.RawSystem, systems.RawPackSystem])
def test_plain_file_systems_restore_bit_exact(cls, tmp_path):
  preset = presets.load_preset("smoke")
  topo = presets.Topology(preset)
  state = presets.build_state(preset, topo)
  system = cls({})
  system.save(str(tmp_path / "ck"), state)
  for mesh in (topo.save_mesh, topo.other_mesh):
    got = system.restore(str(tmp_path / "ck"),
                         presets.abstract_state(preset, mesh))
    assert presets.verify(preset, got) > 0
  if cls is systems.RawPackSystem:  # one file: data and table, one write
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["pack.0.bin"]


def test_distinct_shards_write_each_box_once():
  preset = presets.load_preset("smoke")
  state = presets.build_state(preset, presets.Topology(preset))
  flat = dict(presets.flat_items(state))
  sharded = systems.distinct_shards(flat["params/w0"])  # data x model: 8
  assert len({box for _, box in sharded}) == len(sharded) == 8
  (whole,) = systems.distinct_shards(flat["params/scale"])  # replicated
  assert whole[1] == ((0, 32),)
  assert len(systems.distinct_shards(flat["tokens"])) == 4  # model only
