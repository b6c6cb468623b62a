"""Output helpers of the ``ckpt`` command: sizes, times, tables, JSON,
progress bars (stderr, only on a terminal)."""

from __future__ import annotations

import datetime
import json
import re
import time
import sys
from typing import Any, Sequence

import numpy as np

def human_bytes(n: int | None) -> str:
  if n is None:
    return "-"
  if n < 1024:
    return f"{n} B"
  size, unit = n / 1024, "KiB"
  for bigger in ("MiB", "GiB", "TiB"):
    if size < 1024:
      break
    size, unit = size / 1024, bigger
  return f"{size:.1f} {unit}"


def human_age(seconds: float | None) -> str:
  if seconds is None:
    return "unknown"
  for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
    if seconds >= n:
      return f"{seconds / n:.0f} {unit}"
  return f"{seconds:.0f} s"


def local_time(t: float | None) -> str:
  return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S",
                                             time.localtime(t))


def iso_utc(t: float | None) -> str | None:
  if t is None:
    return None
  return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat()


def table(headers: Sequence[str], rows: list[Sequence[str]],
          right: str = "") -> str:
  """Aligned columns; the columns named in ``right`` align right; the last
  column is never padded."""
  widths = [max(len(str(r[i])) for r in [headers, *rows])
            for i in range(len(headers))]
  lines = []
  for r in [headers, *rows]:
    cells = []
    for i, (cell, w) in enumerate(zip(r, widths)):
      cell = str(cell)
      if i == len(widths) - 1:
        cells.append(cell)
      elif headers[i] in right:
        cells.append(cell.rjust(w))
      else:
        cells.append(cell.ljust(w))
    lines.append("  ".join(cells).rstrip())
  return "\n".join(lines)


def metrics_text(metrics: dict[str, float] | None) -> str:
  return " ".join(f"{k}={v:.6g}" for k, v in sorted((metrics or {}).items()))


def emit(args, doc: Any, text: str) -> None:
  """One JSON document (``--json``) or the human text, on stdout."""
  if args.json:
    print(json.dumps(doc, indent=2, sort_keys=False, default=str))
  elif text:
    print(text)


class Progress:
  """A progress bar on stderr, called as ``bar(done, total)``; silent with
  --quiet, when stderr is not a terminal, or when tqdm is missing."""

  def __init__(self, args, desc: str, unit: str = "B"):
    self.enabled = not args.quiet and sys.stderr.isatty()
    self.desc, self.unit = desc, unit
    self._bar = None

  def __call__(self, done: int, total: int) -> None:
    if not self.enabled:
      return
    if self._bar is None:
      try:
        from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      except ImportError:
        self.enabled = False
        return
      self._bar = tqdm(total=total, desc=self.desc, unit=self.unit,
                       unit_scale=self.unit == "B", unit_divisor=1024,
                       file=sys.stderr, leave=False, dynamic_ncols=True)
    self._bar.total = total
    self._bar.update(done - self._bar.n)

  def __enter__(self) -> "Progress":
    return self

  def __exit__(self, *exc) -> None:
    if self._bar is not None:
      self._bar.close()


def brief(value: Any, width: int = 60) -> str:
  if isinstance(value, bytes):
    text = f"<{len(value)} bytes>"
  elif isinstance(value, (np.ndarray, np.generic)):
    text = np.array2string(np.asarray(value), threshold=8, edgeitems=2,
                           separator=",", max_line_width=10**6)
    text = re.sub(r"\s+", " ", text)
  else:
    text = repr(value)
  return text if len(text) <= width else text[:width - 3] + "..."


def jsonable(value: Any) -> Any:
  if isinstance(value, bytes):
    return {"bytes": len(value)}
  if isinstance(value, (np.ndarray, np.generic)):
    arr = np.asarray(value)
    if arr.size > 16:
      return None
    if arr.dtype.kind == "c":
      return str(arr.tolist())
    if arr.dtype.kind not in "biuf":  # bfloat16, float8: not numpy floats
      arr = arr.astype(np.float64)
    return arr.tolist()
  return value
