"""A save of a step lower than the newest committed one, on a bucket
(docs/multi-host.md, "What the processes agree on"): refused before anything is
written, by the Checkpointer that committed the newer step and by a new
one (a restarted job that has not listed the root yet); a rollback
deletes the newer steps first. The refusal costs no LIST request in a
save once the newest step is known.
"""

from __future__ import annotations

import numpy as np
import pytest

import ckpt
from tests.objectstore.test_requests import count_requests

KW = dict(async_save=False)


def state(step: int) -> dict:
  return {"w": np.full(4096, step, np.float32), "n": np.int64(step)}


@pytest.mark.parametrize("bucket", ["s3_bucket", "gs_bucket"])
def test_lower_step_refused_then_rolled_back(bucket, request):
  url = f"{request.getfixturevalue(bucket)}/rollback"
  with ckpt.Checkpointer(url, **KW) as c:
    assert [c.save(s, state(s)) for s in (1, 2, 3)] == [True] * 3
    with pytest.raises(ckpt.CheckpointError,
                       match=r"cannot save step 2: newer committed step\(s\) "
                             r"\[3\] exist .* call delete\(s\) for each of "
                             r"\[3\]"):
      c.save(2, state(20))
    assert c.save(3, state(30)) is False  # the newest: skipped, as before
  with ckpt.Checkpointer(url, **KW) as restarted:  # knows nothing yet
    with pytest.raises(ckpt.CheckpointError, match=r"\[2, 3\] exist"):
      restarted.save(1, state(10))
    assert restarted.all_steps() == [1, 2, 3]
    assert int(restarted.restore(2)["n"]) == 2  # not overwritten
    restarted.delete(3)
    assert restarted.save(2, state(20)) is False  # now the newest
    restarted.delete(2)
    assert restarted.save(2, state(22)) is True
    assert restarted.all_steps() == [1, 2]
    got = restarted.restore()
    assert int(got["n"]) == 22 and float(got["w"][0]) == 22.0


def test_a_save_lists_nothing_to_check_the_newest_step(s3_server, s3_bucket):
  """The check rests on what the Checkpointer knows (its listing at the
  first save, the saves it committed since): a save's LIST requests are
  only the cleanup's (``pending/``), as test_requests counts them."""
  url = f"{s3_bucket}/rollback-lists"
  with ckpt.Checkpointer(url, **KW) as c:
    c.save(1, state(1))
    c.save(2, state(2))
    assert count_requests(s3_server, url, lambda: c.save(3, state(3))) [
        "LIST"] == 1
    # A refusal lists the committed steps once more (it names them).
    refused = count_requests(s3_server, url, lambda: pytest.raises(
        ckpt.CheckpointError, c.save, 1, state(1)))
    assert refused["LIST"] == 1 and refused["PUT"] == 0, refused
