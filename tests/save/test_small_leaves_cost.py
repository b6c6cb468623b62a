"""The per-leaf work of a later save and of a restore of many small leaves
that is not the limit's (issue 47 item 2, ../shared/limits/limits.py's
``small`` case): each test pins one piece of work that is gone, and that
what replaced it keeps its guarantee (bytes, checksums, a changed leaf
saved as it is now).

Real Checkpointers on the local disk, 8 CPU devices (tests/conftest.py).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.format import entries
from ckpt.format import index as index_lib
from ckpt.format import index_codec
from ckpt.errors import CorruptCheckpointError
from ckpt.restore import pack_exact
from ckpt.restore import pack_read
from ckpt.save import pack
from ckpt.store.names import INDEX_NAME
from tests.save import test_pack
from tests.save.test_pack import saved  # noqa: F401  (a fixture)


def _state(n: int = 6, step: int = 0) -> dict:
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(0)
  rep, shd = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "model"))
  return {
      "replicated": {str(i): jax.device_put(
          rng.standard_normal((24, 32), dtype=np.float32), rep)
                     for i in range(n)},
      "sharded": {str(i): jax.device_put(
          rng.standard_normal((64, 16), dtype=np.float32), shd)
                  for i in range(n)},
      "step": step,
  }


class _CountingNumpy:
  """numpy, with the boxes ``np.ascontiguousarray`` was asked to convert
  counted (every call still goes to numpy)."""

  def __init__(self):
    self.converted = 0

  def __getattr__(self, name):
    return getattr(np, name)

  def ascontiguousarray(self, x, *args, **kwargs):
    self.converted += 1
    return np.ascontiguousarray(x, *args, **kwargs)


def test_views_of_cpu_buffers_are_joined_without_numpy(tmp_path, monkeypatch):
  """A later save joins and checksums each box that is a view of a CPU
  device buffer as it is (numpy's array-from-buffer per box cost more than
  the box's checksum and copy together); the packs restore bit-exact (their
  checksums checked on the read)."""
  state = _state()
  spy = _CountingNumpy()
  with ckpt.Checkpointer(str(tmp_path / "ck"), async_save=False) as c:
    c.save(0, state)
    monkeypatch.setattr(pack, "np", spy)
    c.save(1, state)
    monkeypatch.undo()
    assert spy.converted == 0
    got = c.restore(1, target=state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_index_leaves_of_the_same_entries_are_encoded_once():
  """The leaves map of the very entry objects encoded last (a later save's
  replayed plan) is that map again; one entry that differs encodes anew."""
  index = _index(_state())
  first = index_codec.encode(index.leaves, entries.KINDS_BY_CLASS)
  again = index_codec.encode(list(index.leaves), entries.KINDS_BY_CLASS)
  assert again is first
  assert index_codec.counted(again) == index_codec.containers(again)
  changed = _index(_state(step=3)).leaves  # new objects, one value differs
  got = index_codec.encode(changed, entries.KINDS_BY_CLASS)
  assert got is not first
  assert got == index_codec._encode(changed, entries.KINDS_BY_CLASS)
  assert got["value"] != first["value"]


def test_a_later_save_writes_what_changed(tmp_path):
  """A later save whose plan is replayed (its index's leaves map reused
  where its entries are the same) still records a changed inline value,
  and the index decodes as it was encoded."""
  state = _state()
  root = str(tmp_path / "ck")
  with ckpt.Checkpointer(root, async_save=False) as c:
    c.save(0, state)
    c.save(1, state)
    c.save(2, {**state, "step": 2})
    assert c.restore(1, target=state)["step"] == 0
    assert c.restore(2, target=state)["step"] == 2
  for step in (1, 2):
    path = tmp_path / "ck" / f"checkpoint_{step}" / INDEX_NAME
    index = index_lib.decode(path.read_bytes())
    assert index_lib.decode(index_lib.encode(index)) == index


def _index(state) -> index_lib.Index:
  """The index a save of ``state`` writes (decoded from a real save)."""
  import tempfile  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as d:
    with ckpt.Checkpointer(d, async_save=False) as c:
      c.save(0, state)
    path = f"{d}/checkpoint_0/{INDEX_NAME}"
    with open(path, "rb") as f:
      return index_lib.decode(f.read())


# ---- the restore -----------------------------------------------------------


def test_a_restore_as_saved_makes_no_piece_per_box(tmp_path, monkeypatch):
  """Restored onto the shardings it was saved with, a packed leaf's pieces
  are matched to its boxes for all leaves at once (pack_exact): no Piece
  and no cover worked out per box; the bytes are bit-exact."""
  state = _state()
  made = []
  real = pack_read.PackSet._piece_of
  monkeypatch.setattr(pack_read.PackSet, "_piece_of",
                      lambda self, r, rank: made.append(r) or real(
                          self, r, rank))
  with ckpt.Checkpointer(str(tmp_path / "ck"), async_save=False) as c:
    c.save(1, state)
    got = c.restore(1, target=state)
  assert made == []
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_flipped_byte_restored_as_saved_names_the_leaf(saved):
  root, state = saved
  _, pieces = test_pack._piece_of(root, "w")
  test_pack._flip(test_pack._step(root) / ".packs" / "0.0.bin",
                  pieces[1][2] + 5)
  with ckpt.Checkpointer(root) as c:
    with pytest.raises(CorruptCheckpointError, match="leaf 'w'.*crc32c"):
      c.restore(1, target=state)


@pytest.mark.parametrize("what", ["duplicate", "dropped", "moved"])
def test_pieces_that_are_not_the_boxes_take_the_checked_path(saved, what):
  """A leaf whose pieces are not exactly its boxes (a piece repeated,
  missing, or two claiming one box) is refused by the cover checks,
  naming it, when restored onto the shardings it was saved with."""
  root, state = saved
  pos, _ = test_pack._piece_of(root, "w")

  def edit(doc):
    if what == "moved":  # the second piece claims the first's box
      mine = [p for p in doc["pieces"] if p[0] == pos]
      mine[1][3], mine[1][4] = list(mine[0][3]), list(mine[0][4])
    else:
      test_pack._hostile(doc, pos, what, 2)
  test_pack._edit_table(root, edit)
  with ckpt.Checkpointer(root) as c:
    with pytest.raises(CorruptCheckpointError, match="leaf 'w'"):
      c.restore(1, target=state)


def test_merged_ranges_as_the_pairwise_merge():
  """pack_exact.merged_ranges against the plain merge it replaces."""
  rng = np.random.default_rng(3)
  for _ in range(50):
    n = int(rng.integers(1, 40))
    proc, pk = rng.integers(0, 2, n), rng.integers(0, 3, n)
    a = rng.integers(0, 1 << 12, n)
    b = a + rng.integers(1, 300, n)
    want: dict = {}
    for key in sorted(set(zip(proc.tolist(), pk.tolist()))):
      ranges = sorted((x, y) for p, k, x, y in zip(proc.tolist(), pk.tolist(),
                                                   a.tolist(), b.tolist())
                      if (p, k) == key)
      merged = [list(ranges[0])]
      for x, y in ranges[1:]:
        if x - merged[-1][1] <= 100:
          merged[-1][1] = max(merged[-1][1], y)
        else:
          merged.append([x, y])
      want[key] = merged
    assert pack_exact.merged_ranges(proc, pk, a, b, 100) == want
