"""Issue 45 item 8, the papercuts with behaviour: a misspelt top-level key
of a restore target gets a "did you mean" (the error of a save called on
one process only, saying why a process waits ``barrier_timeout_s``, is
pinned in tests/test_errors.py). The README's list of pages
(tests/test_readme.py), a CPU multi-process example (docs/multi-host.md,
run by tests/test_docs.py) and docs/reference.md outside the site
(tests/test_reference_page.py) are checked where those pages are."""

from __future__ import annotations

import numpy as np
import pytest

import ckpt


def test_a_misspelt_top_level_key_gets_a_did_you_mean(tmp_path):
  with ckpt.Checkpointer(tmp_path, async_save=False) as c:
    c.save(1, {"params": {"w": np.ones(4)}, "opt_state": {"mu": np.ones(4)}})
    with pytest.raises(ckpt.MissingLeavesError,
                       match=r"Did you mean 'params' for the target's "
                       r"'parms' \(a top-level key\)\?"):
      c.restore(1, target={"parms": {"w": np.zeros(4)},
                           "opt_state": {"mu": np.zeros(4)}})
