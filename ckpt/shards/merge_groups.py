"""The OCDBT merge group of each array of a step (format "ocdbt"): a step
with more than ``ckpt.store.ocdbt.KEYS_PER_MERGE`` keys is split into
groups of contiguous arrays with about equal keys, each merged by its own
process (ckpt/store/ocdbt.py says why). Every process computes the same
groups from the same plan (``plan.spread``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ckpt.shards import plan as plan_lib
from ckpt.store import ocdbt


def assign_groups(keys: Sequence[int], process_count: int,
                  keys_per_merge: int | None = None) -> list[int | None]:
  """The merge group of each array, given how many keys (chunks plus its
  metadata) each has, in index order; all None when one merge suffices.
  Every process computes the same from the same plan: contiguous runs of
  arrays with about equal keys (plan.spread)."""
  per = keys_per_merge or ocdbt.KEYS_PER_MERGE
  groups = min(process_count, ocdbt.MAX_GROUPS, math.ceil(sum(keys) / per))
  if groups <= 1:
    return [None] * len(keys)
  owner = plan_lib.spread(np.asarray(keys, dtype=np.int64), groups)
  return [int(g) for g in owner]
