"""The leaves of an index (version 2): columns, with what repeats stored once.

Version 1 wrote one map per leaf with every field spelled out: 455 bytes a
leaf for a transformer's state and 5 s of CPU to decode 100,000 of them,
most of it validating the same shape, chunks, codec and mesh again and
again. Version 2's ``leaves`` is a map of columns, each list one long per
leaf, and two tables:

  "names": [str, ...]         every distinct path part, once
  "specs": [map, ...]         every distinct spec, once: a leaf's map as
                              version 1 wrote it, less its path and its
                              per-leaf fields; "kind" names its Kind
  "spec":  [int, ...]         per leaf: its spec, a number into "specs"
  "path":  [[int, ...], ...]  per leaf: its path parts, numbers into "names"
  "<field>": [any, ...]       per leaf, one column per per-leaf field of the
                              kinds (nil for a leaf that has none); a column
                              no leaf uses is left out

A reader validates each spec once, when the first leaf using it is decoded
(so an error names that leaf), every number against its table, and per
leaf only its per-leaf fields; a spec no leaf uses is refused.

Adding a kind of entry (or a per-leaf field): describe it with a ``Kind``
in ``index.KINDS``: its spec's key and map, its per-leaf columns and a
decoder that validates a spec once and returns the function that builds
each leaf's entry from its path and per-leaf values. A field that is the
same for many leaves belongs in the spec (stored once, validated once); one
that differs per leaf gets a column. Nothing here changes.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Hashable

# A decoder's leaf builder: (path parts, per-leaf values in Kind.columns
# order, where) -> the entry (raising CorruptCheckpointError).
Builder = Callable[[tuple, tuple, Any], Any]


@dataclasses.dataclass(frozen=True)
class Kind:
  """How one kind of index entry is stored in version 2.

  ``name``: the spec's "kind" ("array", "value"); ``cls``: its entry class;
  ``columns``: the entry's per-leaf fields, each a column of that name;
  ``key(entry)``: entries with equal keys share one spec; ``spec(entry)``:
  the spec's map (without "kind"); ``leaf(entry)``: the per-leaf values,
  in ``columns`` order (None: not stored); ``decoder(spec, where)``:
  validates a spec read from a checkpoint (CorruptCheckpointError naming
  ``where``) and returns the Builder of its leaves' entries.
  """
  name: str
  cls: type
  columns: tuple[str, ...]
  key: Callable[[Any], Hashable]
  spec: Callable[[Any], dict]
  leaf: Callable[[Any], tuple]
  decoder: Callable[[dict, Any], Builder]


_TABLES = ("names", "specs", "spec", "path")


def encode(entries, kinds: dict[type, Kind]) -> dict[str, Any]:
  """The ``leaves`` map of an index of these entries."""
  n = len(entries)
  names: dict[str, int] = {}
  specs: dict[Hashable, int] = {}
  spec_maps: list[dict] = []
  spec_col, path_col = [0] * n, [None] * n
  columns: dict[str, list] = {}
  for i, e in enumerate(entries):
    kind = kinds[type(e)]
    key = (kind.name, kind.key(e))
    s = specs.get(key)
    if s is None:
      s = specs[key] = len(spec_maps)
      spec_maps.append({"kind": kind.name, **kind.spec(e)})
    spec_col[i] = s
    path_col[i] = [names.setdefault(p, len(names)) for p in e.path]
    for name, v in zip(kind.columns, kind.leaf(e)):
      if v is not None:
        col = columns.get(name)
        if col is None:
          col = columns[name] = [None] * n
        col[i] = v
  return {"names": list(names), "specs": spec_maps, "spec": spec_col,
          "path": path_col, **columns}


def decode(doc: Any, where: str, kinds: dict[str, Kind],
           bad: Callable[[Any, str, Any], Exception],
           leaf_where: Callable[[str, int], Any]) -> tuple:
  """The entries of a ``leaves`` map read from a checkpoint, validated.

  ``bad(where, expected, found)`` makes the error; ``leaf_where(where, i)``
  says where leaf ``i`` is (its ``path`` attribute is set once known)."""
  if not isinstance(doc, dict):
    raise bad(where, "leaves as a map of columns", doc)
  known = set(_TABLES).union(*(k.columns for k in kinds.values()))
  unknown = [k for k in doc if k not in known]
  if unknown:
    raise bad(where, f"leaves columns among {sorted(known)}", unknown)
  names, specs = doc.get("names"), doc.get("specs")
  if not isinstance(names, list) or not all(isinstance(p, str) for p in names):
    raise bad(where, "leaves names as a list of strings", names)
  if not isinstance(specs, list):
    raise bad(where, "leaves specs as a list of maps", specs)
  spec_col = doc.get("spec")
  _numbers(spec_col, len(specs), where, "spec", bad)
  n = len(spec_col)
  path_col = doc.get("path")
  if (not isinstance(path_col, list) or len(path_col) != n or
      not all(type(p) is list for p in path_col)):
    raise bad(where, f"leaves path as {n} lists of numbers into names",
              path_col)
  _numbers(list(itertools.chain.from_iterable(path_col)), len(names), where,
           "path", bad)
  per_leaf = sorted(known.difference(_TABLES))
  columns = []
  for name in per_leaf:
    col = doc.get(name)
    if col is not None and (not isinstance(col, list) or len(col) != n):
      raise bad(where, f"leaves column {name} as a list of {n} values",
                col)
    columns.append(col if col is not None else [None] * n)
  builders: list = [None] * len(specs)
  out = [None] * n
  get = names.__getitem__
  # One ``where`` for every leaf (an error is formatted when raised).
  w = leaf_where(where, 0)
  rows = zip(*columns) if columns else itertools.repeat(())
  for i, (s, ids, row) in enumerate(zip(spec_col, path_col, rows)):
    w.i = i
    path = w.path = tuple(map(get, ids))
    built = builders[s]
    if built is None:
      spec = specs[s]
      kind = kinds.get(spec.get("kind")) if isinstance(spec, dict) else None
      if kind is None:
        raise bad(w, f"a spec map of kind {' or '.join(map(repr, kinds))}",
                  spec)
      built = builders[s] = (kind.decoder(spec, w), _getter(
          [per_leaf.index(c) for c in kind.columns]))
    build, values = built
    out[i] = build(path, values(row), w)
  if None in builders:
    raise bad(where, "every spec used by a leaf",
              f"spec {builders.index(None)} used by none")
  return tuple(out)


def _getter(positions: list[int]) -> Callable[[tuple], tuple]:
  """The values at ``positions`` of a row, as a tuple."""
  if len(positions) == 1:
    return lambda row, p=positions[0]: (row[p],)
  return lambda row: tuple([row[p] for p in positions])


def _numbers(v: Any, size: int, where: str, what: str,
             bad: Callable[[Any, str, Any], Exception]) -> None:
  """``v`` is a list of ints in [0, size): checked in C over the list."""
  if (not isinstance(v, list) or not set(map(type, v)) <= {int} or
      v and not 0 <= min(v) <= max(v) < size):
    raise bad(where, f"leaves {what} as numbers in [0, {size})", v)
