"""Progress of a long save or restore, for the caller: ``progress=`` of
``Checkpointer.save``, ``restore`` and ``restore_async``.

``progress`` is None (nothing), True (a tqdm bar on this process's stderr)
or ``fn(done_bytes, total_bytes)``: bytes this process has written (save)
or read (restore) so far, and the total it will (None when not known in
advance). It is polled on the Checkpointer's background loop every
``PERIOD_S`` while the operation runs, and called once more at its end;
``fn`` runs on that thread and must be quick and never raise (an exception
is logged and the reporting stops).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from absl import logging

PERIOD_S = 0.5


def reporter(progress: Any, what: str, total: Callable[[], int | None]
             ) -> Callable[[int], None] | None:
  """``fn(done)`` reporting to ``progress`` (see the module docstring), or
  None for no progress; ValueError for anything else. ``total()`` is asked
  only when there is progress to report."""
  if progress is None or progress is False:
    return None
  if progress is True or callable(progress):
    total = total()
  if progress is True:
    import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm.tqdm(total=total, unit="B", unit_scale=True, desc=what,
                    leave=False)
    seen = [0]

    def to_bar(done: int) -> None:
      bar.update(done - seen[0])
      seen[0] = done
      if total is not None and done >= total:
        bar.close()
    return to_bar
  if not callable(progress):
    raise ValueError(f"progress must be None, True or fn(done_bytes, "
                     f"total_bytes), got {progress!r}")
  return lambda done: progress(done, total)


async def reported(coro, report: Callable[[int], None] | None,
                   done: Callable[[], int]) -> Any:
  """Runs ``coro`` (on the loop), calling ``report(done())`` every
  PERIOD_S meanwhile and once when it ends, before its result is
  returned."""
  if report is None:
    return await coro
  failed = []

  def call() -> None:
    if failed:
      return
    try:
      report(done())
    except Exception as e:  # pylint: disable=broad-except
      failed.append(e)
      logging.warning("ckpt: the progress callback failed (no more progress "
                      "reports for this operation): %s", e)

  async def tick() -> None:
    while True:
      call()
      await asyncio.sleep(PERIOD_S)
  ticker = asyncio.ensure_future(tick())
  try:
    return await coro
  finally:
    ticker.cancel()
    await asyncio.gather(ticker, return_exceptions=True)
    call()


def size_text(n: float) -> str:
  """``n`` bytes for a log line: "1.50 GiB"."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} TiB"


def rate_text(n: float, seconds: float) -> str:
  """``n`` bytes in ``seconds`` for a log line: "1.52 GB/s", or in MB/s
  below 1 GB/s ("3.4 MB/s": a small save never reads "0.00 GB/s")."""
  rate = n / seconds if seconds > 0 else 0.0
  if rate >= 1e9:
    return f"{rate / 1e9:.2f} GB/s"
  return f"{rate / 1e6:.3g} MB/s" if rate >= 1e5 else f"{rate / 1e6:.2f} MB/s"
