"""Hugging Face keys to target paths, and back.

``names`` (of ``load_safetensors`` and ``export_safetensors``) is one of:

- None: a key is the target path itself (``params/dense/kernel``, as ckpt's
  own safetensors export writes them).
- a dict ``{hf_key: path}``; a path of None drops the key on purpose.
- a list of ``(regex, replacement)`` pairs: the first regex that matches the
  whole key gives ``re.Match.expand(replacement)``; a replacement of None
  drops the keys it matches.
- a function ``key -> path`` (None drops it); load only: a function cannot
  be reversed.

A path may end in ``[i]`` (the tensor is index i of the target leaf's
leading axis: per-layer keys stacked into one scanned array) and then
``.T`` (the tensor transposed: Flax keeps kernels (in, out) where Hugging
Face keeps (out, in)). A key no rule matches is left over (an error naming
it), as is a target leaf no key maps to (missing).

Export reverses each rule: a dict by its values; a regex pair by reading the
replacement as a regex (its group references become groups) and the regex
as a template (each group its value). That needs a regex of literal text,
escapes of punctuation and groups (``(\\d+)``, ``(?P<n>q|k|v)``) only, each
group used by the replacement; any other regex is refused by name, with the
fix (a dict, or a regex of that form). Every key found is checked by the
forward rule (it must map back to the same path).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from ckpt.errors import TreeMismatchError

_PLACE = re.compile(r"^(?P<path>.+?)(?:\[(?P<i>\d+)\])?(?P<t>\.T)?$")
UNMATCHED = object()  # forward(): no rule matches the key


@dataclasses.dataclass(frozen=True)
class Place:
  """Where a tensor goes: the target leaf ``path``, at ``index`` of its
  leading axis (None: the whole leaf), transposed or not."""
  path: str
  index: int | None = None
  transpose: bool = False

  def text(self) -> str:
    return (self.path + ("" if self.index is None else f"[{self.index}]")
            + (".T" if self.transpose else ""))


def parse_place(text: str, key: str) -> Place:
  if not isinstance(text, str) or not text:
    raise TreeMismatchError(
        f"names maps {key!r} to {text!r}; expected a target path string "
        "(or None to drop the key)")
  m = _PLACE.match(text)
  i = m.group("i")
  return Place(m.group("path"), None if i is None else int(i),
               m.group("t") is not None)


class NotReversible(TreeMismatchError):
  """A name rule export cannot reverse."""


class Names:
  """One ``names`` argument, applied forward (load) and reversed (export)."""

  def __init__(self, names: Any):
    self.names = names
    if names is None or isinstance(names, dict) or callable(names):
      self.rules = None
    elif isinstance(names, (list, tuple)):
      self.rules = []
      for rule in names:
        if (not isinstance(rule, (list, tuple)) or len(rule) != 2 or
            not isinstance(rule[0], str) or
            not isinstance(rule[1], (str, type(None)))):
          raise TypeError(f"names: each rule must be a (regex, replacement "
                          f"or None) pair, got {rule!r}")
        try:
          self.rules.append((re.compile(rule[0]), rule[1]))
        except re.error as e:
          raise TypeError(f"names: {rule[0]!r} is not a regex: {e}"
                          ) from None
    else:
      raise TypeError("names must be None, a dict, a list of (regex, "
                      f"replacement) pairs or a function, got "
                      f"{type(names).__name__}")
    self._inverse: dict[str, str] | None = None
    self._reversed: list | None = None

  def forward(self, key: str) -> Any:
    """The target path text of ``key``; None: dropped; UNMATCHED."""
    n = self.names
    if n is None:
      return key
    if isinstance(n, dict):
      return n[key] if key in n else UNMATCHED
    if self.rules is None:
      return n(key)
    for rx, repl in self.rules:
      m = rx.fullmatch(key)
      if m is not None:
        return None if repl is None else m.expand(repl)
    return UNMATCHED

  # ---- export ---------------------------------------------------------------

  def key_of(self, text: str) -> str | None:
    """The Hugging Face key whose forward rule gives ``text`` (None: none
    does)."""
    n = self.names
    if n is None:
      return text
    if isinstance(n, dict):
      if self._inverse is None:
        self._inverse = {}
        for k, v in n.items():
          if v is None:
            continue
          if v in self._inverse:
            raise NotReversible(
                f"names maps both {self._inverse[v]!r} and {k!r} to {v!r}; "
                "export cannot tell which key to write")
          self._inverse[v] = k
      return self._inverse.get(text)
    if self.rules is None:
      raise NotReversible(
          "names is a function, which export cannot reverse; pass a dict "
          "or a list of (regex, replacement) pairs")
    if self._reversed is None:
      self._reversed = [_reverse(rx, repl) for rx, repl in self.rules
                        if repl is not None]
    for inverse, template in self._reversed:
      m = inverse.fullmatch(text)
      if m is None:
        continue
      key = "".join(p if isinstance(p, str) else m.group(f"g{p}")
                    for p in template)
      if self.forward(key) == text:
        return key
    return None


def _reverse(rx: re.Pattern, repl: str) -> tuple[re.Pattern, list]:
  """(the replacement as a regex with a group ``g<N>`` per group it uses,
  the regex as a template: literal strings and group numbers)."""
  template = _template(rx)
  used: set[int] = set()
  out = []
  i = 0
  while i < len(repl):
    c = repl[i]
    if c != "\\":
      out.append(re.escape(c))
      i += 1
      continue
    m = re.match(r"\\(?:(\d+)|g<(\w+)>)", repl[i:])
    if m is None:
      if repl[i:i + 2] == "\\\\":
        out.append(re.escape("\\"))
        i += 2
        continue
      raise NotReversible(f"names: the replacement {repl!r} has an escape "
                          "export cannot reverse")
    g = m.group(1) or m.group(2)
    n = int(g) if g.isdigit() else rx.groupindex.get(g)
    if n is None:
      raise NotReversible(f"names: {repl!r} names no group of {rx.pattern!r}")
    out.append(f"(?P=g{n})" if n in used else f"(?P<g{n}>.+?)")
    used.add(n)
    i += m.end()
  unused = {p for p in template if isinstance(p, int)} - used
  if unused:
    raise NotReversible(
        f"names: the replacement {repl!r} of {rx.pattern!r} does not use "
        f"group(s) {sorted(unused)}, so export cannot rebuild the key")
  return re.compile("".join(out)), template


def _template(rx: re.Pattern) -> list:
  """``rx.pattern`` as literal text and group numbers, or NotReversible."""
  p, out, i, group = rx.pattern, [], 0, 0
  if p.startswith("^"):
    i = 1
  end = len(p) - 1 if p.endswith("$") and not p.endswith("\\$") else len(p)

  def refuse(what: str):
    return NotReversible(
        f"names: export cannot reverse the regex {rx.pattern!r} ({what}); "
        "use literal text, escaped punctuation and capture groups only, or "
        "pass names as a dict")
  while i < end:
    c = p[i]
    if c == "\\":
      nxt = p[i + 1:i + 2]
      if not nxt or nxt.isalnum():
        raise refuse(f"{p[i:i + 2]!r} outside a group")
      out.append(nxt)
      i += 2
    elif c == "(":
      if p.startswith("(?", i) and not p.startswith("(?P<", i):
        raise refuse("a group that captures nothing")
      group += 1
      out.append(group)
      i = _close(p, i, refuse) + 1
    elif c in ".^$*+?{}[]|)":
      raise refuse(f"{c!r} outside a group")
    else:
      out.append(c)
      i += 1
  return out


def _close(p: str, i: int, refuse: Callable) -> int:
  """The index of the ``)`` closing the group opened at ``p[i]``; groups
  inside a group are refused (their numbers would shift the template)."""
  j, in_class, depth = i + 1, False, 0
  while j < len(p):
    c = p[j]
    if c == "\\":
      j += 2
      continue
    if in_class:
      in_class = c != "]"
    elif c == "[":
      in_class = True
    elif c == "(":
      if not p.startswith("(?:", j):
        raise refuse("a capture group inside a group")
      depth += 1
    elif c == ")":
      if not depth:
        return j
      depth -= 1
    j += 1
  raise refuse("an unclosed group")
