"""Packed small leaves across real ``jax.distributed`` processes
(``pack_worker.py``; 127.0.0.1, gloo, TensorStore on the local disk).

4 processes x 2 devices save 48 small leaves, each sharded over all 8
devices (every process writes one box of every leaf into its own pack),
then restore them:

- onto the saved sharding, each process reads only the pieces it places:
  about its own pack, not all four (before: every process read every pack
  that held a piece of a leaf it needed, i.e. all of them: 4x);
- onto the other dimension (every process needs a column of every piece):
  bit-exact too.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import launch as launch_lib
from tests.multiprocess import pack_worker

WORKER = "tests.multiprocess.pack_worker"
PROCESSES, DEVICES = 4, 2


@pytest.fixture(scope="module")
def restored(tmp_path_factory) -> list[pack_worker.Result]:
  root = str(tmp_path_factory.mktemp("pack_mp") / "ckpt")
  # One job saves, then restores with a new Checkpointer (nothing cached
  # between the two: the restore's reads are counted at the store).
  return launch_lib.launch(WORKER, {"dir": root}, PROCESSES, DEVICES,
                           result=pack_worker.Result)


def test_each_process_reads_only_the_pieces_it_places(restored):
  for r in restored:
    assert r.same_exact, r
    assert r.own_pack_bytes * PROCESSES == r.all_pack_bytes, r
    # its own pack, plus the 4 tables (a few KB): far under a second pack
    assert r.own_pack_bytes <= r.same_fetched, r
    assert r.same_fetched < r.own_pack_bytes * 1.5, r


def test_restore_onto_another_dimension_is_exact(restored):
  for r in restored:
    assert r.other_exact, r
    assert r.other_fetched >= r.all_pack_bytes * 0.9, r
