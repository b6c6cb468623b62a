"""Bytes fetched from the store, as TensorStore's kvstore drivers count them.

TensorStore keeps, per process, a counter of the bytes each kvstore driver
read (``/tensorstore/kvstore/<driver>/bytes_read``: the bodies of the GETs
its s3 and gcs drivers received, the bytes its file driver read). That is
what the store served this process, after any cache, whole chunks and
compression included, which the boxes a restore asks for (``bytes_read``)
are not. Drivers that read through another kvstore (ocdbt) are left out,
so that nothing counts twice.

The counter is process-wide: a ``Meter`` takes its difference over the
spans it is entered (overlapping spans of one meter count once), so reads
by anything else in this process during those spans (another
Checkpointer's restore, a user's own TensorStore reads) count too.
"""

from __future__ import annotations

import threading

from absl import logging
import tensorstore as ts

_PREFIX = "/tensorstore/kvstore/"
_SUFFIX = "/bytes_read"
_ADAPTERS = ("ocdbt",)  # read through a base kvstore, counted there
_WARNED = False


def fetched() -> int:
  """Bytes every base kvstore driver of this process has read so far (0
  where this TensorStore has no metrics: statistics never fail a read)."""
  try:
    metrics = ts.experimental_collect_matching_metrics(_PREFIX)
  except Exception as e:  # pylint: disable=broad-except
    global _WARNED
    if not _WARNED:
      _WARNED = True
      logging.warning("ckpt: TensorStore's kvstore metrics are not "
                      "available (%s); fetched_bytes stays 0", e)
    return 0
  total = 0
  for m in metrics:
    name = m["name"]
    if not name.endswith(_SUFFIX):
      continue
    if name[len(_PREFIX):-len(_SUFFIX)] in _ADAPTERS:
      continue
    total += sum(int(v.get("value", 0)) for v in m["values"])
  return total


class Meter:
  """Bytes fetched during the spans it is entered (``with meter:``)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._active = 0
    self._base = 0
    self._total = 0

  def __enter__(self) -> "Meter":
    with self._lock:
      if not self._active:
        self._base = fetched()
      self._active += 1
    return self

  def __exit__(self, *exc) -> None:
    with self._lock:
      self._active -= 1
      if not self._active:
        self._total += fetched() - self._base

  @property
  def value(self) -> int:
    """So far (including a span still open)."""
    with self._lock:
      if self._active:
        return self._total + fetched() - self._base
      return self._total
