"""format="ocdbt": every process writes its own database; finalize merges.

Each process writes the zarr3 arrays it owns into its own OCDBT database,
``<step>/ocdbt.process_<i>/`` (a manifest and a few data files under
``d/``), with no coordination at all. After the "written" barrier, process 0
merges them into the step's database at ``<step>/`` (``manifest.ocdbt`` and
``d/``): one atomic TensorStore transaction that copies each per-process
B+tree into the step's tree with ``experimental_copy_range_to``. OCDBT copies
references to the data files, not the data, so the merge reads and writes
only B+tree nodes (kilobytes for thousands of arrays). The merged tree refers
to ``ocdbt.process_<i>/d/...`` by paths relative to the step directory, so
the per-process directories must stay (they hold the data) and the step
directory can be renamed, moved or copied between stores. A restore opens
only the step's database and reads any slice of any array, onto any number
of processes.

Why not TensorStore's ``ocdbt_coordinator`` (one database written
cooperatively, as in jax's array serialization):
- it needs a gRPC server on process 0 that every host reaches on one more
  port, and every write of every process takes leases through it: the data
  path would depend on one process's server for the whole save;
- every commit of every process is a conditional write of the shared
  manifest, so processes contend on it; per-process databases never
  conflict, and only the merge writes the step's manifest, once;
- the merge is one small, atomic metadata step at a place the commit
  protocol already has (process 0, between the barrier and the index).
What the merge costs: reading every per-process B+tree (not the data) and
inserting each key into the merged tree, about 4.6 us per key on one core
(scripts/scale_merge.py): 46 s and several GB for 1,000 processes x 10,000
leaves (10 million keys) if one process did it. So a step with more than
``KEYS_PER_MERGE`` keys is split into merge groups (``assign_groups`` in
ckpt/shards/merge_groups.py, computed by every process from the plan): the
arrays of group g live under ``<step>/ocdbt.group_<g>/``, where each
process writes its own database ``ocdbt.process_<i>/`` for that group, and
process g (mod the process count) merges them into the group's database, all groups at once. A copy
only works into a database whose directory holds the source's data files
(TensorStore answers "CopyRange not supported" for a sibling directory),
which is why groups are directories and not key ranges of one database.
Each array's index entry records its group; a reader opens that group's
database. A step of up to ``KEYS_PER_MERGE`` keys has one group at the
step's root, as before. OCDBT batches concurrent writes into few data
files, so a state of 10,000 small leaves becomes a few dozen files, not
20,000.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import tensorstore as ts

from ckpt.store import storage as storage_lib
from ckpt.store import tsfuture
from ckpt.errors import CheckpointError
from ckpt.store import urls

PROCESS_DIR_PREFIX = "ocdbt.process_"
GROUP_DIR_PREFIX = "ocdbt.group_"
# Keys one process merges (about 1 s at 4.6 us per key); more make groups.
KEYS_PER_MERGE = 250_000
# The most merge groups a step may have: what an index may name
# (ckpt/format/entries.py checks it as MAX_OCDBT_GROUPS).
MAX_GROUPS = 4096


def database(base: dict[str, Any]) -> dict[str, Any]:
  """The kvstore spec of the OCDBT database stored in ``base`` (a directory).

  Its B+tree nodes are cached in the context's ``cache_pool#ocdbt``, which
  every context from ``Storage.context()`` defines (a restore of 2,000 small
  leaves from S3 takes half the time with it).
  """
  spec: dict[str, Any] = {"driver": "ocdbt", "base": base,
                          "cache_pool": storage_lib.OCDBT_CACHE_POOL}
  if base.get("driver") in ("gcs", "s3"):
    # Reads of neighbouring values (small chunks of one data file) are
    # merged into one request.
    spec.update(experimental_read_coalescing_threshold_bytes=1 << 20,
                experimental_read_coalescing_merged_bytes=256 << 20,
                experimental_read_coalescing_interval="1ms")
  return spec


def process_dir(process: int) -> str:
  return f"{PROCESS_DIR_PREFIX}{int(process)}"


def group_base(step_kvstore: dict[str, Any], group: int | None
               ) -> dict[str, Any]:
  """The directory of merge group ``group`` (None: the step itself). The
  name is built here from a checked int, never read from a checkpoint."""
  if group is None:
    return step_kvstore
  if type(group) is not int or not 0 <= group < MAX_GROUPS:
    raise CheckpointError(f"invalid OCDBT merge group {group!r}")
  return urls.join(step_kvstore, f"{GROUP_DIR_PREFIX}{group}")


def group_database(step_kvstore: dict[str, Any], group: int | None
                   ) -> dict[str, Any]:
  """The merged database holding the arrays of ``group``, to read."""
  return database(group_base(step_kvstore, group))


def process_database(step_kvstore: dict[str, Any], process: int,
                     group: int | None = None) -> dict[str, Any]:
  """Where ``process`` writes its arrays of ``group`` into ``step_kvstore``."""
  return database(urls.join(group_base(step_kvstore, group),
                                   process_dir(process)))


def merges_of(process: int, process_count: int, groups: int) -> list[int]:
  """The groups ``process`` merges (group g: process g mod the count)."""
  return list(range(process, groups, process_count))


async def merge(step_kvstore: dict[str, Any], process_count: int,
                context: ts.Context, group: int | None = None) -> None:
  """After every process has written: one database for ``group`` (None:
  the step's only one, at its root) from the per-process ones.

  A process that wrote nothing has no database; it reads as empty.
  """
  base = group_base(step_kvstore, group)
  try:
    parent, *children = await asyncio.gather(
        tsfuture.wait(ts.KvStore.open(database(base), context=context)),
        *(tsfuture.wait(ts.KvStore.open(process_database(base, p),
                                        context=context))
          for p in range(process_count)))
    txn = ts.Transaction(atomic=True)
    target = parent.with_transaction(txn)
    await asyncio.gather(*(tsfuture.wait(c.experimental_copy_range_to(target))
                           for c in children))
    await tsfuture.wait(txn.commit_async())
  except Exception as e:
    raise CheckpointError(
        f"merging the OCDBT databases of {process_count} processes under "
        f"{base.get('path')!r} into one failed: {e}") from e


async def write_batch(writes: list[Callable[[ts.Transaction],
                                             Awaitable[Any]]],
                      what: Callable[[], str]) -> None:
  """Writes a batch of boxes into a process's database in ONE transaction,
  so one OCDBT commit (a data file and a few B+tree nodes) per batch, not
  per box. ``writes``: each box's write, given the transaction (emptied
  once every write is in the transaction: the callers' references to the
  data are dropped before the commit); ``what()``: the batch named for a
  failed commit. A failure aborts the transaction (nothing of the batch is
  committed). The transaction is atomic: nothing of it is written back
  before the commit (a plain one, with the context's array cache of 0
  bytes, wrote parts of a batch back early, as commits of their own: a
  batch of 16 boxes became one to three data files, a count that varied
  from run to run). Used by the thread writer
  (ckpt/save/write.py) and the writer process (ckpt/save/writer_main.py),
  which cut the same batches (each up to the save's budget), so that both
  leave the same files."""
  txn = ts.Transaction(atomic=True)
  try:
    await asyncio.gather(*(w(txn) for w in writes))
    writes.clear()
    try:
      await tsfuture.wait(txn.commit_async())
    except Exception as e:
      raise CheckpointError(f"committing {what()} failed: {e}") from e
  except BaseException:
    if not txn.commit_started:
      txn.abort()
    raise
