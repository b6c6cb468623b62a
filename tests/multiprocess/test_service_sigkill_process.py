"""The SIGKILL loop of tests/multiprocess/test_service_sigkill.py with the
writer process (issue 50): the same kills, checks and figures.

A file of its own: with ``--dist loadfile`` a file runs on one worker, and
the two loops are the suite's longest tests, so pytest-xdist's two workers
run them side by side instead of one after the other.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import test_service_sigkill as loop


@pytest.mark.parametrize("writer", ["process"])
def test_sigkill_during_saves_keeps_committed_checkpoints(tmp_path, writer):
  loop.test_sigkill_during_saves_keeps_committed_checkpoints(tmp_path, writer)
