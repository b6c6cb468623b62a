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


def encode_structure(tree: Any) -> Any:
  """The tree's shape as plain data; each leaf becomes its number in
  ``flatten(tree)``'s order (an int: the index's leaf of that number)."""
  count = 0

  def walk(node: Any, parts: PathParts) -> Any:
    nonlocal count
    if node is None:
      return {"node": "none"}
    level = _one_level(node)
    if level is None:
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
      return {"node": "dict", "keys": keys, "children": encoded}
    if isinstance(node, list):
      return {"node": "list", "children": encoded}
    if type(node) is tuple:
      return {"node": "tuple", "children": encoded}
    return {"node": "object", "type": type(node).__qualname__,
            "keys": [key_name(k) for k, _ in children], "children": encoded}

  return walk(tree, ())


def decode_structure(encoded: Any, leaf_value) -> Any:
  """Rebuilds nested python values; ``leaf_value(i)`` gives leaf number
  ``i`` (e.g. ``values.__getitem__`` of a list in the index's order)."""

  def walk(node: Any) -> Any:
    if type(node) is int:
      return leaf_value(node)
    kind = node["node"]
    if kind == "none":
      return None
    children = [walk(c) for c in node.get("children", [])]
    if kind == "dict" or kind == "object":
      return dict(zip(node["keys"], children))
    if kind == "list":
      return children
    return tuple(children)

  return walk(encoded)


def iter_structure_leaves(encoded: Any) -> Iterator[int]:
  """The leaf numbers of a structure, in no particular order."""
  stack = [encoded]
  while stack:
    node = stack.pop()
    if type(node) is int:
      yield node
    else:
      stack.extend(node.get("children", []))


def leaf_paths(encoded: Any) -> Iterator[tuple[int, PathParts]]:
  """(number, path parts) of each leaf of a well-formed structure, the
  parts being what ``flatten`` names the leaf at that place."""
  stack = [(encoded, ())]
  while stack:
    node, parts = stack.pop()
    if type(node) is int:
      yield node, parts
      continue
    children = node.get("children") or ()
    keys = node.get("keys") or range(len(children))
    stack.extend((c, parts + (str(k),)) for k, c in zip(keys, children))


def numbered(encoded: Any, number: dict[str, int]) -> Any:
  """A structure whose leaves are ``{"leaf": "<path>"}`` (index versions 1
  and 2, validated) with each leaf replaced, in place, by ``number[path]``."""
  if "leaf" in encoded:
    return number[encoded["leaf"]]
  stack = [encoded]
  while stack:
    node = stack.pop()
    children = node.get("children")
    if not children:
      continue
    for j, c in enumerate(children):
      if "leaf" in c:
        children[j] = number[c["leaf"]]
      else:
        stack.append(c)
  return encoded


def named(encoded: Any, names: list[str]) -> Any:
  """A copy of a structure with leaf ``i`` as ``{"leaf": names[i]}``, as
  index versions 1 and 2 wrote it (the inverse of ``numbered``; for tools
  and tests that write an older index)."""
  if type(encoded) is int:
    return {"leaf": names[encoded]}
  if not isinstance(encoded, dict):
    return encoded
  out = dict(encoded)
  if isinstance(out.get("children"), list):
    out["children"] = [named(c, names) for c in out["children"]]
  return out


def storage_relpath(parts: PathParts) -> str:
  """A safe relative directory for a leaf's array, one folder per part."""
  return "/".join(map(_safe_part, parts)) if parts else "_root"


@functools.lru_cache(maxsize=1 << 16)
def _safe_part(p: str) -> str:
  # A part starting with "." would be hidden and is refused on restore
  # (index.check_relpath); escaping works on UTF-8 bytes so that it stays
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
