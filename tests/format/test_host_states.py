"""The host_state files a save writes and the count its index records
(ckpt/format/extras.py): each process's own value, or EveryProcess (an
import of another job's per-process state); the count every process agrees
on in the save round."""

from __future__ import annotations

import msgpack
import pytest

from ckpt.errors import InvalidStateError
from ckpt.format import extras


def test_own_value_is_one_file_and_a_claim():
  files, claim = extras.host_state_files({"pos": 3}, 1, 2)
  assert list(files) == [1] and msgpack.unpackb(files[1]) == {"pos": 3}
  assert claim == ["own", True]
  files, claim = extras.host_state_files(None, 0, 2)
  assert list(files) == [0] and claim == ["own", False]


@pytest.mark.parametrize("n,pid,want", [(1, 0, [0, 1, 2]), (2, 0, [0, 2]),
                                        (2, 1, [1]), (4, 3, [])])
def test_every_process_is_shared_out_by_process(n, pid, want):
  values = extras.EveryProcess([{"p": i} for i in range(3)])
  files, claim = extras.host_state_files(values, pid, n)
  assert sorted(files) == want and claim == ["every", 3]
  assert [msgpack.unpackb(files[i]) for i in want] == [{"p": i} for i in want]


def test_the_count_every_process_agrees_on():
  own = lambda gave: ["own", gave]  # noqa: E731
  assert extras.host_state_count({0: own(False), 1: own(False)}, 2) == 0
  assert extras.host_state_count({0: own(False), 1: own(True)}, 2) == 2
  assert extras.host_state_count({0: ["every", 5], 1: ["every", 5]}, 2) == 5
  for bad in ({0: ["every", 5], 1: ["every", 4]},
              {0: ["every", 5], 1: own(True)}, {0: ["every", 0]},
              {0: "junk"}):
    with pytest.raises(InvalidStateError, match="disagree"):
      extras.host_state_count(bad, len(bad))
  with pytest.raises(InvalidStateError):
    extras.EveryProcess([])
