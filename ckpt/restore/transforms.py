"""Restore transforms: reshape a checkpoint's tree to fit today's model.

A transform is ``fn(ckpt_tree, target_tree, *, is_resuming) -> ckpt_tree``
over nested dicts keyed by path parts. Array leaves of ``ckpt_tree`` are
``ckpt.restore.lazy.LazyLeaf`` objects: a transform can rename, drop, add, stack or
slice them without reading data, and only the leaves that end up in the
restored result are read (only the boxes each process needs).

The helpers here build such transforms. Patterns are regular expressions
matched in full against ``/``-joined leaf paths (``params/dense/kernel``).
A pattern that matches nothing is an error (it is usually a typo), unless
``strict=False``.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from ckpt.restore import lazy
from ckpt.restore import lazy_derived
from ckpt.format import tree
from ckpt.errors import TreeMismatchError

Transform = Callable[..., dict]


def _flat(ckpt_tree: Any) -> dict[str, Any]:
  return {tree.path_str(p): v for p, v in tree.unnest(ckpt_tree).items()}


def _nested(flat: dict[str, Any]) -> dict:
  for name in flat:
    parts = name.split("/")
    for i in range(1, len(parts)):
      prefix = "/".join(parts[:i])
      if prefix in flat:
        raise TreeMismatchError(
            f"{prefix!r} would be both a leaf and the parent of {name!r}")
  return tree.nest({tuple(k.split("/")): v for k, v in flat.items()})


def unmatched(what: str, pattern: str, names) -> TreeMismatchError:
  """The error a helper raises for a pattern that matches no leaf (it
  lists the leaves), for transforms of your own to raise alike.

  Args:
    what: the helper's name, for the message.
    pattern: the pattern that matched nothing.
    names: the leaf paths there were.

  Returns the error (does not raise it). Not collective.
  """
  shown = sorted(names)[:20]
  return TreeMismatchError(
      f"{what} pattern {pattern!r} matches no checkpoint leaf; leaves are: "
      f"{shown}{' ...' if len(names) > 20 else ''}")


def rename(pattern: str, replacement: str, *, strict: bool = True) -> Transform:
  """Leaves whose path matches ``pattern`` move to ``m.expand(replacement)``.

  ``rename(r"params/(.*)/w", r"params/\\1/kernel")``

  Args:
    pattern: a regex matched against the whole ``/``-joined leaf path.
    replacement: ``re.Match.expand`` template of the new path.
    strict: refuse a pattern that matches no leaf.

  Raises (when the returned transform runs):
    TreeMismatchError: a pattern that matches nothing (with ``strict``) or two
      leaves renamed to one path, naming the paths.

  The transform is pure (no I/O, nothing read): not collective, but give
  every process the same transforms.
  """
  regex = re.compile(pattern)

  def fn(ckpt_tree, target_tree=None, *, is_resuming=False):
    del target_tree, is_resuming
    flat = _flat(ckpt_tree)
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    hits = 0
    for name, leaf in flat.items():
      m = regex.fullmatch(name)
      new = m.expand(replacement) if m else name
      hits += bool(m)
      if new in out:
        raise TreeMismatchError(
            f"rename {pattern!r} -> {replacement!r}: {name!r} and "
            f"{origin[new]!r} both become {new!r}")
      out[new], origin[new] = leaf, name
    if strict and not hits:
      raise unmatched("rename", pattern, flat)
    return _nested(out)

  return fn


def drop(pattern: str, *, strict: bool = True) -> Transform:
  """Leaves whose path matches ``pattern`` are removed (never read).

  Args:
    pattern: a regex matched against the whole leaf path.
    strict: refuse a pattern that matches no leaf.

  Raises (when the returned transform runs):
    TreeMismatchError: a pattern that matches nothing (with ``strict``),
      naming the paths.

  The transform is pure (no I/O, nothing read): not collective, but give
  every process the same transforms.
  """
  regex = re.compile(pattern)

  def fn(ckpt_tree, target_tree=None, *, is_resuming=False):
    del target_tree, is_resuming
    flat = _flat(ckpt_tree)
    out = {k: v for k, v in flat.items() if not regex.fullmatch(k)}
    if strict and len(out) == len(flat):
      raise unmatched("drop", pattern, flat)
    return _nested(out)

  return fn


def assignment_map(rules: Sequence[tuple[str, str | None]]) -> Transform:
  """T5X-style: for each TARGET leaf, the first rule whose pattern matches
  its path says where it comes from in the checkpoint (``m.expand(repl)``),
  or, with ``None``, that it is not restored (the fallback state gives it).
  Target leaves no rule matches come from the same path. The result holds
  only target leaves, so nothing else is read. Every rule must be used.

  Args:
    rules: ``[(pattern, replacement or None), ...]`` over target paths.

  Raises (when the returned transform runs):
    TreeMismatchError: no restore target, a rule that matches no target leaf
      or a source that does not exist (all listed), naming the paths.

  The transform is pure (no I/O, nothing read): not collective, but give
  every process the same transforms.
  """
  compiled = [(re.compile(p), p, r) for p, r in rules]

  def fn(ckpt_tree, target_tree=None, *, is_resuming=False):
    del is_resuming
    if target_tree is None:
      raise TreeMismatchError("assignment_map needs a restore target")
    flat = _flat(ckpt_tree)
    out: dict[str, Any] = {}
    used: set[str] = set()
    missing: list[str] = []
    for name in _flat(target_tree):
      for regex, pattern, repl in compiled:
        m = regex.fullmatch(name)
        if m:
          used.add(pattern)
          if repl is not None:
            src = m.expand(repl)
            if src not in flat:
              missing.append(f"{name} <- {src}")
            else:
              out[name] = flat[src]
          break
      else:
        if name in flat:
          out[name] = flat[name]
    if missing:
      raise TreeMismatchError(
          f"assignment_map: these target leaves map to checkpoint paths that "
          f"do not exist: {missing}")
    unused = [p for _, p, _ in compiled if p not in used]
    if unused:
      raise TreeMismatchError(
          f"assignment_map: patterns {unused} match no target leaf")
    return _nested(out)

  return fn


def stack_layers(layer_pattern: str = r"layers_(\d+)", stacked: str = "layers",
                 *, axis: int = 0, strict: bool = True) -> Transform:
  """Per-layer leaves ``…/layers_0/w … layers_N/w`` become one leaf
  ``…/layers/w`` with a new axis of size N+1 (scan-over-layers). Lazy: a
  process reads only the layers and boxes its devices hold.

  Args:
    layer_pattern: a regex for one path part, whose group 1 is the layer
      number.
    stacked: the name of the stacked part.
    axis: where the new layer axis goes.
    strict: refuse a pattern that matches no leaf.

  Raises (when the returned transform runs):
    TreeMismatchError: layers not numbered 0..N without gaps, of different
      shapes or dtypes, or (with ``strict``) no layer found, naming the paths.

  The transform is pure (no I/O, nothing read): not collective, but give
  every process the same transforms.
  """
  regex = re.compile(layer_pattern)

  def fn(ckpt_tree, target_tree=None, *, is_resuming=False):
    del target_tree, is_resuming
    flat = _flat(ckpt_tree)
    out: dict[str, Any] = {}
    groups: dict[str, dict[int, tuple[str, Any]]] = {}
    for name, leaf in flat.items():
      parts = name.split("/")
      hit = next(((i, m) for i, p in enumerate(parts)
                  if (m := regex.fullmatch(p))), None)
      if hit is None:
        out[name] = leaf
        continue
      i, m = hit
      key = "/".join(parts[:i] + [stacked] + parts[i + 1:])
      groups.setdefault(key, {})[int(m.group(1))] = (name, leaf)
    if strict and not groups:
      raise unmatched("stack_layers", layer_pattern, flat)
    for key, members in groups.items():
      if key in out:
        raise TreeMismatchError(
            f"stack_layers: {key!r} exists already and would be replaced by "
            f"the stack of {[n for n, _ in members.values()][:5]}")
      idx = sorted(members)
      if idx != list(range(len(idx))):
        raise TreeMismatchError(
            f"stack_layers: {key!r} has layers {idx}; expected 0..{len(idx) - 1} "
            "with none missing")
      leaves = []
      for i in idx:
        name, leaf = members[i]
        leaf = _lazy(leaf, name, "stack_layers")
        leaves.append(leaf)
      out[key] = lazy_derived.LazyStack(leaves, axis, path=key)
    return _nested(out)

  return fn


def unstack_layers(stacked: str = "layers", layer_format: str = "layers_{}",
                   *, axis: int = 0, strict: bool = True) -> Transform:
  """The inverse of stack_layers: ``…/layers/w`` with N entries on ``axis``
  becomes ``…/layers_0/w … layers_{N-1}/w``, each read lazily.

  Args:
    stacked: the name of the stacked path part.
    layer_format: the name of each layer's part (``"layers_{}"``).
    axis: the layer axis.
    strict: refuse when no path has a ``stacked`` part.

  Raises (when the returned transform runs):
    TreeMismatchError: no stacked leaf found (with ``strict``) or a layer that
      already exists, naming the paths.

  The transform is pure (no I/O, nothing read): not collective, but give
  every process the same transforms.
  """

  def fn(ckpt_tree, target_tree=None, *, is_resuming=False):
    del target_tree, is_resuming
    flat = _flat(ckpt_tree)
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    hits = 0
    for name, leaf in flat.items():
      parts = name.split("/")
      if stacked not in parts:
        if name in out:
          raise TreeMismatchError(
              f"unstack_layers: {name!r} exists already (from {origin[name]!r})")
        out[name], origin[name] = leaf, name
        continue
      hits += 1
      i = parts.index(stacked)
      leaf = _lazy(leaf, name, "unstack_layers")
      if not 0 <= axis < len(leaf.shape):
        raise TreeMismatchError(
            f"unstack_layers: {name!r} has shape {tuple(leaf.shape)}, no axis "
            f"{axis} to unstack")
      for k in range(leaf.shape[axis]):
        new = "/".join(parts[:i] + [layer_format.format(k)] + parts[i + 1:])
        if new in out:
          raise TreeMismatchError(
              f"unstack_layers: {new!r} from {name!r} exists already "
              f"(from {origin[new]!r})")
        out[new], origin[new] = lazy_derived.LazySlice(leaf, axis, k, path=new), name
    if strict and not hits:
      raise unmatched("unstack_layers", stacked, flat)
    return _nested(out)

  return fn


def _lazy(leaf: Any, name: str, what: str) -> lazy.LazyLeaf:
  if isinstance(leaf, lazy.LazyLeaf):
    return leaf
  raise TreeMismatchError(
      f"{what}: {name!r} is a {type(leaf).__name__}, not an array")
