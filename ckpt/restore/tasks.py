"""Running restore coroutines: ``run_sync`` runs one to completion from
synchronous code (on a private thread with its own event loop, so it works
under a caller's running loop), and ``gather_or_cancel`` gathers reads and,
on the first failure, cancels and awaits the rest so that no read outlives
a failed restore. Imports nothing of ckpt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures


def run_sync(coro):
  """Runs a coroutine to completion from synchronous code.

  A private thread with its own event loop, so it works even when the caller
  already runs an event loop (never nests asyncio.run in the caller's thread).
  """
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(asyncio.run, coro).result()


async def gather_or_cancel(*coros):
  """asyncio.gather that, on the first failure, cancels and awaits the rest
  (so no read keeps running after a restore has failed)."""
  tasks = [asyncio.ensure_future(c) for c in coros]
  try:
    return await asyncio.gather(*tasks)
  except BaseException:
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    raise
