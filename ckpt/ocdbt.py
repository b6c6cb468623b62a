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
What the merge costs: process 0 reads every per-process B+tree (not the
data) before it commits, and a step has one manifest per process plus the
merged one. OCDBT batches concurrent writes into few data files, so a state
of 10,000 small leaves becomes a few dozen files, not 20,000.
"""

from __future__ import annotations

import asyncio
from typing import Any

import tensorstore as ts

from ckpt import storage as storage_lib
from ckpt.errors import CheckpointError

PROCESS_DIR_PREFIX = "ocdbt.process_"


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


def process_database(step_kvstore: dict[str, Any], process: int
                     ) -> dict[str, Any]:
  """Where ``process`` writes its arrays of a save into ``step_kvstore``."""
  return database(storage_lib.join(step_kvstore, process_dir(process)))


async def merge(step_kvstore: dict[str, Any], process_count: int,
                context: ts.Context) -> None:
  """Process 0, after every process has written: one database at the step.

  A process that wrote nothing has no database; it reads as empty.
  """
  try:
    parent, *children = await asyncio.gather(
        ts.KvStore.open(database(step_kvstore), context=context),
        *(ts.KvStore.open(process_database(step_kvstore, p), context=context)
          for p in range(process_count)))
    txn = ts.Transaction(atomic=True)
    target = parent.with_transaction(txn)
    await asyncio.gather(*(c.experimental_copy_range_to(target)
                           for c in children))
    await txn.commit_async()
  except Exception as e:
    raise CheckpointError(
        f"merging the OCDBT databases of {process_count} processes under "
        f"{step_kvstore.get('path')!r} into one failed: {e}") from e
