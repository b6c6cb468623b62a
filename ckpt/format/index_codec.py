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
in ``entries.KINDS``: its spec's key and map, its per-leaf columns and a
decoder that validates a spec once and returns the function that builds
each leaf's entry from its path and per-leaf values. A field that is the
same for many leaves belongs in the spec (stored once, validated once); one
that differs per leaf gets a column. Nothing here changes.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
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


# The entries last encoded, the kinds, their ``leaves`` map and its
# ``containers`` (None until asked): a later save of the same state replays
# its plan (ckpt/save/plan_cache.py), so its index holds the very same
# entry objects (frozen), and their map is the one encoded last time: with
# 10,000 leaves, encoding it again cost a tenth of the save's CPU.
_last: tuple = ((), None, None, None)


def encode(entries, kinds: dict[type, Kind]) -> dict[str, Any]:
  """The ``leaves`` map of an index of these entries (the same map, shared
  and never to be changed, when they are the very objects encoded last)."""
  global _last
  prev, prev_kinds, got, _ = _last
  if (prev_kinds is kinds and len(prev) == len(entries)
      and all(map(operator.is_, prev, entries))):
    return got
  got = _encode(entries, kinds)
  _last = (tuple(entries), kinds, got, None)
  return got


def counted(leaves: dict[str, Any]) -> tuple[int, int, int]:
  """``containers`` of a ``leaves`` map from ``encode``, counted once per
  map."""
  global _last
  last = _last
  if last[2] is not leaves:
    return containers(leaves)
  if last[3] is None:
    _last = last = (*last[:3], containers(leaves))
  return last[3]


def _encode(entries, kinds: dict[type, Kind]) -> dict[str, Any]:
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
  if not isinstance(spec_col, list):
    raise bad(where, "leaves spec as a list of numbers into specs", spec_col)
  n = len(spec_col)
  path_col = doc.get("path")
  if not isinstance(path_col, list) or len(path_col) != n:
    raise bad(where, f"leaves path as {n} lists of numbers into names",
              path_col)
  # Checked in C over all leaves; the first leaf at fault is named.
  if not _numbers(spec_col, len(specs)):
    i = next(i for i, s in enumerate(spec_col) if not _numbers([s], len(specs)))
    raise bad(leaf_where(where, i), f"a spec number in [0, {len(specs)})",
              spec_col[i])
  if (not all(type(p) is list for p in path_col) or not _numbers(
      list(itertools.chain.from_iterable(path_col)), len(names))):
    i = next(i for i, p in enumerate(path_col)
             if type(p) is not list or not _numbers(p, len(names)))
    raise bad(leaf_where(where, i), "path as a list of numbers into the "
              f"{len(names)} names", path_col[i])
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
      name = spec.get("kind") if isinstance(spec, dict) else None
      kind = kinds.get(name) if isinstance(name, str) else None
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


def _numbers(v: list, size: int) -> bool:
  """``v`` is a list of ints in [0, size) (checked in C over the list)."""
  return set(map(type, v)) <= {int} and (
      not v or 0 <= min(v) and max(v) < size)


# ---- what a document packs to: decode's container budget (index.py) ------

def containers(doc: Any) -> tuple[int, int, int]:
  """(lists, maps, the longest's length) of the msgpack document ``doc``
  packs to, counted on the python objects (no re-parsing); raises
  ValueError for a map key that decode would refuse (not a str)."""
  lists = maps = longest = 0
  stack = [doc]
  pop, push = stack.pop, stack.extend
  while stack:
    x = pop()
    longest = max(longest, len(x))
    if isinstance(x, dict):
      maps += 1
      if not set(map(type, x)) <= {str}:
        raise ValueError(f"a map key that is not a string in {list(x)[:8]}")
      x = x.values()
    else:
      lists += 1
    types = set(map(type, x))
    if types <= _SCALARS:  # the common cases: no containers in x,
      continue
    if types == {list} and set(map(type, itertools.chain.from_iterable(
        x))) <= _SCALARS:  # lists of scalars only (a column of paths)
      lists += len(x)
      longest = max(longest, max(map(len, x), default=0))
    elif types <= _NESTED:  # or only containers
      push(x)
    else:
      push([v for v in x if isinstance(v, _NESTED_TUPLE)])
  return lists, maps, longest


_SCALARS = {str, int, float, bool, bytes, type(None)}
_NESTED = {dict, list, tuple}
_NESTED_TUPLE = (dict, list, tuple)


# ---- the same leaves as version 1's maps (tools and tests) -----------------

def rows(doc: dict) -> list:
  """A well-formed ``leaves`` map as version 1's list of entry maps (each
  leaf's spec, per-leaf fields and path as a list of strings). Unvalidated:
  for tools and tests that read or edit an index's leaves."""
  names, specs = doc["names"], doc["specs"]
  per_leaf = [k for k in doc if k not in _TABLES]
  out = []
  for i, (s, ids) in enumerate(zip(doc["spec"], doc["path"])):
    row = {"path": [names[j] for j in ids], **specs[s]}
    row.update((k, doc[k][i]) for k in per_leaf if doc[k][i] is not None)
    out.append(row)
  return out


def columns(maps: list, kinds: dict[str, Kind]) -> dict[str, Any]:
  """Version 1's list of entry maps as a ``leaves`` map (the inverse of
  ``rows``), whatever the maps hold: a field a leaf of its kind keeps per
  leaf goes to that column, the rest to its spec; a path that is not a list
  of strings and a leaf that is not a map are written as they are, for a
  reader to refuse. Unvalidated: for tools and tests."""
  import msgpack  # pylint: disable=g-import-not-at-top
  per_leaf = sorted(set().union(*(k.columns for k in kinds.values())))
  names: dict[str, int] = {}
  specs: dict[bytes, int] = {}
  out: dict[str, Any] = {"names": [], "specs": [], "spec": [], "path": []}
  for c in per_leaf:
    out[c] = [None] * len(maps)
  for i, m in enumerate(maps):
    spec, path = m, None
    if isinstance(m, dict):
      kind = kinds.get(m["kind"]) if isinstance(m.get("kind"), str) else None
      own = kind.columns if kind else ()
      spec = {k: v for k, v in m.items() if k != "path" and k not in own}
      for c in own:
        out[c][i] = m.get(c)
      path = m.get("path")
    if isinstance(path, list) and all(isinstance(p, str) for p in path):
      path = [names.setdefault(p, len(names)) for p in path]
    key = msgpack.packb(spec, use_bin_type=True)
    out["spec"].append(specs.setdefault(key, len(specs)))
    if specs[key] == len(out["specs"]):
      out["specs"].append(spec)
    out["path"].append(path)
  out["names"] = list(names)
  return {k: v for k, v in out.items()
          if k in _TABLES or any(x is not None for x in v)}
