"""Stage 1 of save: a PyTree becomes named leaves plus a plain structure.

Leaf names come from ``jax.tree_util`` key paths (``params/encoder/kernel``).
The structure is recorded as plain msgpack-able data, so a checkpoint can be
read back without the user's classes (and without pickle): dicts stay dicts,
lists and tuples stay lists and tuples, and custom nodes (dataclasses, flax
structs, NamedTuples) come back as dicts keyed by their field names. A leaf
of the structure is its number (an int) in the flattened leaves' order,
which is the order of the index's leaves.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterator

from jax import tree_util

from ckpt.errors import InvalidStateError

PathParts = tuple[str, ...]
_SAFE_PART = re.compile(r"^[A-Za-z0-9_.\-]+$")


def key_name(key: Any) -> str:
  """The path part of one jax.tree_util key entry."""
  if isinstance(key, tree_util.DictKey):
    return str(key.key)
  if isinstance(key, tree_util.SequenceKey):
    return str(key.idx)
  if isinstance(key, tree_util.GetAttrKey):
    return key.name
  if isinstance(key, tree_util.FlattenedIndexKey):
    return str(key.key)
  return str(key)


def path_str(parts: PathParts) -> str:
  return "/".join(parts) if parts else "<root>"


def flatten(tree: Any) -> list[tuple[PathParts, Any]]:
  """Leaves in jax.tree_util order, each with its path parts.

  ``None`` is a node with no leaves (as in jax), not a leaf.
  """
  leaves, _ = tree_util.tree_flatten_with_path(tree)
  out = []
  seen: dict[str, PathParts] = {}
  for keypath, leaf in leaves:
    parts = tuple(key_name(k) for k in keypath)
    name = path_str(parts)
    if name in seen:
      raise InvalidStateError(
          f"two leaves share the path {name!r} (keys {keypath} and an earlier "
          "one render the same); give them distinct string keys")
    seen[name] = parts
    out.append((parts, leaf))
  return out


def _one_level(node: Any):
  """Children of ``node`` with their keys, or None if ``node`` is a leaf."""
  children, treedef = tree_util.tree_flatten_with_path(
      node, is_leaf=lambda x: x is not node)
  if tree_util.treedef_is_leaf(treedef) and treedef.num_leaves == 1:
    return None
  return [(path[0], child) for path, child in children], treedef


# Types jax flattened as leaves (a type is a leaf, or a node, for all its
# values): ``encode_structure`` tells them at once, without a
# ``tree_flatten`` of each leaf.
_LEAF_TYPES: set[type] = set()


# A node of the structure is a list, its kind first; a leaf is an int:
#   ["dict", key, child, key, child, ...]     keys str or int
#   ["object", "<type name>", key, child, ...] a custom node (keys str)
#   ["list", child, ...]   ["tuple", child, ...]   ["none"]
# (index versions 1 and 2 wrote maps: {"node": "dict", "keys": [...],
# "children": [...]}, a leaf {"leaf": "<path>"}; see numbered/named.)
# The offset of a keyed node's first key: its keys are node[k::2], its
# children node[k + 1::2].
KEYED = {"dict": 1, "object": 2}


def encode_structure(tree: Any) -> Any:
  """The tree's shape as plain data (lists, see KEYED); each leaf becomes
  its number in ``flatten(tree)``'s order (an int: the index's leaf of
  that number)."""
  count = 0

  def walk(node: Any, parts: PathParts) -> Any:
    nonlocal count
    if node is None:
      return ["none"]
    kind = type(node)
    if kind in _LEAF_TYPES:
      count += 1
      return count - 1
    if kind is dict and all(type(k) is str for k in node):
      # jax's order for a dict of str keys: sorted (as _one_level's)
      keys = sorted(node)
      return ["dict", *_pairs(keys, [walk(node[k], parts + (k,))
                                     for k in keys])]
    if kind is list or kind is tuple:
      encoded = [walk(c, parts + (str(i),)) for i, c in enumerate(node)]
      return ["list" if kind is list else "tuple", *encoded]
    level = _one_level(node)
    if level is None:
      _LEAF_TYPES.add(kind)
      count += 1
      return count - 1
    children, _ = level
    encoded = [walk(c, parts + (key_name(k),)) for k, c in children]
    if isinstance(node, dict):
      keys = [k.key for k, _ in children]
      bad = [k for k in keys if not isinstance(k, (str, int))]
      if bad:
        raise InvalidStateError(
            f"dict at {path_str(parts)!r} has keys {bad!r}; only str and int "
            "keys can be stored")
      return ["dict", *_pairs(keys, encoded)]
    if isinstance(node, list):
      return ["list", *encoded]
    if type(node) is tuple:
      return ["tuple", *encoded]
    return ["object", type(node).__qualname__,
            *_pairs([key_name(k) for k, _ in children], encoded)]

  return walk(tree, ())


def _pairs(keys: list, children: list) -> list:
  out = [None] * (2 * len(keys))
  out[::2], out[1::2] = keys, children
  return out


def _keys_children(node: list) -> tuple[Any, list]:
  """A (well-formed) node's keys (a range for a list or tuple) and
  children."""
  k = KEYED.get(node[0])
  if k is not None:
    return node[k::2], node[k + 1::2]
  children = node[1:]
  return range(len(children)), children


def decode_structure(encoded: Any, leaf_value) -> Any:
  """Rebuilds nested python values; ``leaf_value(i)`` gives leaf number
  ``i`` (e.g. ``values.__getitem__`` of a list in the index's order)."""

  def walk(node: Any) -> Any:
    if type(node) is int:
      return leaf_value(node)
    kind = node[0]
    if kind == "none":
      return None
    k = KEYED.get(kind)
    if k is not None:
      return dict(zip(node[k::2], map(walk, node[k + 1::2])))
    children = [walk(c) for c in node[1:]]
    return children if kind == "list" else tuple(children)

  return walk(encoded)


def iter_structure_leaves(encoded: Any) -> Iterator[int]:
  """The leaf numbers of a structure, in no particular order."""
  stack = [encoded]
  while stack:
    node = stack.pop()
    if type(node) is int:
      yield node
    else:
      stack.extend(_keys_children(node)[1])


def leaf_paths(encoded: Any, n: int) -> list[PathParts]:
  """The path parts of leaves 0 to n - 1 of a well-formed structure
  (checks.check_numbered_structure), each what ``flatten`` names the leaf
  at its place."""
  out: list[PathParts] = [()] * n
  if type(encoded) is int:
    return out
  stack = [(encoded, ())]
  pop, push, keyed = stack.pop, stack.append, KEYED.get
  while stack:
    node, parts = pop()
    k = keyed(node[0])
    pairs = (enumerate(node[1:]) if k is None else
             zip(node[k::2], node[k + 1::2]))
    for key, c in pairs:
      p = (*parts, key if type(key) is str else str(key))
      if type(c) is int:
        out[c] = p
      else:
        push((c, p))
  return out


def numbered(encoded: Any, number: dict[str, int]) -> Any:
  """Today's form of a structure of index version 1 or 2 (validated by
  checks.check_structure): its maps as lists, each leaf ``{"leaf":
  "<path>"}`` as ``number[path]``."""
  if "leaf" in encoded:
    return number[encoded["leaf"]]
  kind = encoded["node"]
  if kind == "none":
    return ["none"]
  children = [numbered(c, number) for c in encoded.get("children", [])]
  if kind == "dict":
    return ["dict", *_pairs(encoded["keys"], children)]
  if kind == "object":
    return ["object", encoded.get("type"), *_pairs(encoded["keys"], children)]
  return [kind, *children]


def named(encoded: Any, names: list[str]) -> Any:
  """A structure as index versions 1 and 2 wrote it, leaf ``i`` as
  ``{"leaf": names[i]}`` (the inverse of ``numbered``; for tools and tests
  that write an older index). Unvalidated."""
  if type(encoded) is int:
    return {"leaf": names[encoded]}
  kind = encoded[0]
  if kind == "none":
    return {"node": "none"}
  keys, children = _keys_children(encoded)
  out = {"node": kind, "children": [named(c, names) for c in children]}
  if kind in KEYED:
    out["keys"] = list(keys)
  if kind == "object":
    out["type"] = encoded[1]
  return out


def storage_relpath(parts: PathParts) -> str:
  """A safe relative directory for a leaf's array, one folder per part."""
  return "/".join(map(_safe_part, parts)) if parts else "_root"


@functools.lru_cache(maxsize=1 << 16)
def _safe_part(p: str) -> str:
  # A part starting with "." would be hidden and is refused on restore
  # (checks.check_relpath); escaping works on UTF-8 bytes so that it stays
  # one-to-one ("\u20ac" and " AC" must not both become "%20AC").
  if not _SAFE_PART.match(p) or p.startswith("."):
    p = "".join(c if re.match(r"[A-Za-z0-9_\-]", c) else
                "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))
                for c in p) or "%"
  return p


def nest(flat: dict[PathParts, Any]) -> Any:
  """{("a", "b"): x} -> {"a": {"b": x}}: the tree restore transforms see."""
  if () in flat:
    return flat[()]
  out: dict[str, Any] = {}
  for parts, leaf in flat.items():
    node = out
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = leaf
  return out


def transformed(state: Any, transforms) -> Any:
  """``state`` after the save transforms ``fn(state_dict) -> state_dict``,
  applied in order to nested dicts keyed by path parts (``state`` itself
  when there are none)."""
  if not transforms:
    return state
  state = nest(dict(flatten(state)))
  for fn in transforms:
    state = fn(state)
  return state


def unnest(nested: Any) -> dict[PathParts, Any]:
  """The inverse of nest: nested dicts to {path parts: leaf}."""
  if not isinstance(nested, dict):
    return {(): nested}
  out: dict[PathParts, Any] = {}
  stack: list[tuple[PathParts, dict]] = [((), nested)]
  while stack:
    prefix, node = stack.pop()
    for k, v in node.items():
      parts = prefix + (str(k),)
      if isinstance(v, dict):
        stack.append((parts, v))
      else:
        out[parts] = v
  return out
