"""Issue 45 item 8: docs/reference.md read as empty stubs outside the
built site (its `:::` lines are mkdocstrings directives). It opens with
every public name and every call of the checkpointers in one line each:
the first sentence of its docstring, kept equal to it here."""

from __future__ import annotations

import inspect
import pathlib
import re

import ckpt

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "reference.md"


def _summary(obj) -> str:
  first = (inspect.getdoc(obj) or "").split("\n\n")[0].replace("\n", " ")
  m = re.match(r"(.+?\.)(\s|$)", first)
  return (m.group(1) if m else first).replace("``", "`")


def _rows() -> list[str]:
  rows = [f"| `ckpt.{n}` | {_summary(getattr(ckpt, n))} |"
          for n in ckpt.__all__]
  seen = set()
  for cls in (ckpt.Checkpointer, ckpt.MultiTierCheckpointer):
    for attr, member in inspect.getmembers(cls):
      if attr.startswith("_") or attr in seen:
        continue
      seen.add(attr)
      static = inspect.getattr_static(cls, attr)
      obj = static.fget if isinstance(static, property) else member
      mark = "" if cls is ckpt.Checkpointer else " (`MultiTierCheckpointer`)"
      rows.append(f"| `{attr}`{mark} | {_summary(obj)} |")
  return rows


def test_the_reference_page_reads_without_the_site():
  text = PAGE.read_text()
  head = text.split("\n::: ", 1)[0]  # before the first directive
  missing = [r for r in _rows() if r not in head]
  assert not missing, ("docs/reference.md's tables differ from the "
                       "docstrings; the rows as they should read:\n"
                       + "\n".join(missing))
