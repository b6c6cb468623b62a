"""The save plan of the last save, reused while the state keeps its layout.

A training job saves the same tree (same structure, shapes, dtypes and
shardings) at every checkpoint, and everything ``save.plan_save`` decides
for an array leaf depends on that layout only: its stored dtype, chunks,
sharding description and saved sharding, this process's boxes and which of
the replicated chunks it writes, the structure recorded in the index. So
the second save of a job plans nothing new: ``PlanCache.plan`` checks that
the layout is unchanged (one ``jax.tree_util.tree_flatten``, in C++, and a
comparison per leaf) and builds the plan from the cached one, with the new
arrays as the sources. Values stored in the index itself (scalars, strings,
small arrays) are read again at every save (``save.inline_leaf``).

The key, compared exactly (``==``, identity first):
- the tree's ``PyTreeDef`` (node types, dict keys and other node data);
- per leaf: for a ``jax.Array`` its shape, dtype and sharding (which also
  decide whether it is stored inline: fully replicated and small); for a
  numpy array its shape and dtype; for a scalar its type (and dtype);
- the save options (format, codec, chunk size, ``save_dtype``, inline and
  item byte limits), the partitioner (the same object: a partitioner must
  give the same sharding for the same leaf name and shape, as it already
  must on every process), and this process's index and the process count.
Anything else (a ``LeafSource`` of ``ckpt import``, an unknown leaf type)
is planned from scratch every time, and a bad leaf raises the planner's own
error, naming it.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import numpy as np

from ckpt.multihost import process as multihost
from ckpt.save import leaves as leaves_lib
from ckpt.save import staging
from ckpt.format import tree

_SCALARS = (bool, int, float, str, bytes)


def _signature(x: Any):
  """What the plan of leaf ``x`` depends on, or None: not cacheable."""
  if staging.is_array(x):
    return (jax.Array, x.shape, x.dtype, x.sharding)
  if isinstance(x, np.ndarray):
    return (np.ndarray, x.shape, x.dtype)
  if isinstance(x, np.generic):
    return (np.generic, x.dtype)
  if type(x) in _SCALARS:
    return (type(x),)
  return None


@dataclasses.dataclass(eq=False)
class _Template:
  key: tuple  # (treedef, options, id(partitioner), partitioner, process, count)
  signatures: list  # per leaf, ``_signature``
  plan: leaves_lib.SavePlan
  # Per leaf: True for a leaf stored in the index (its value read again at
  # every save), False for an array leaf; and whether it is a PRNG key array.
  inline: list[bool]
  keys: list[bool]
  # Per leaf: a jax.Array leaf's concrete type, else None (``_replay``'s
  # fast check: its type, shape, dtype and sharding, no tuple made).
  types: list


class PlanCache:
  """One Checkpointer's last save plan (see the module docstring).

  ``hits`` and ``misses`` count the plans reused and made; a save's own
  ``SaveStats.planned_leaves`` says how many leaves it planned anew."""

  def __init__(self):
    self._template: _Template | None = None
    self._lock = threading.Lock()
    self.hits = 0
    self.misses = 0

  def clear(self) -> None:
    with self._lock:
      self._template = None

  def plan(self, state: Any, options: leaves_lib.SaveOptions, partitioner=None,
           *, process_count: int | None = None, process: int | None = None
           ) -> tuple[leaves_lib.SavePlan, int]:
    """(the plan of ``state``, how many leaves were planned anew: 0 when
    the cached plan was reused)."""
    process_count = process_count or multihost.process_count()
    process = multihost.process_index() if process is None else process
    leaves, treedef = jax.tree_util.tree_flatten(state)
    key = (treedef, options, id(partitioner), partitioner, process,
           process_count)
    with self._lock:
      template = self._template
    if template is not None and _same(template.key, key):
      got = _replay(template, leaves, options)
      if got is not None:
        self.hits += 1
        return got, 0
    plan = leaves_lib.plan_save(state, options, partitioner,
                              process_count=process_count, process=process)
    self.misses += 1
    signatures = [_signature(x) for x in leaves]
    if (all(s is not None for s in signatures)
        and len(plan.leaves) == len(leaves)):
      template = _Template(
          key, signatures, dataclasses.replace(
              plan, leaves=[leaves_lib.LeafPlan(lp.parts, None, lp.entry,
                                                lp.layout)
                            for lp in plan.leaves]),
          [lp.layout is None for lp in plan.leaves],
          [s[0] is jax.Array and leaves_lib.is_key(s[2])
           for s in signatures],
          [type(x) if s[0] is jax.Array else None
           for x, s in zip(leaves, signatures)])
    else:
      template = None
    with self._lock:
      self._template = template
    return plan, len(plan.leaves)


def _same(a: tuple, b: tuple) -> bool:
  # The partitioner is compared by identity (its id, and the object kept
  # alive so that the id is not reused).
  return a[0] == b[0] and a[1] == b[1] and a[2] == b[2] and a[4:] == b[4:]


def _replay(template: _Template, leaves: list, options: leaves_lib.SaveOptions
            ) -> leaves_lib.SavePlan | None:
  """The cached plan with this save's arrays as sources and its inline
  values read again, or None if a leaf's signature differs from the
  cached one. One pass over the leaves: an array leaf of the cached type
  is checked attribute by attribute (shape, dtype, sharding: the same
  comparisons as its signature's, with no tuple made)."""
  old = template.plan
  if len(leaves) != len(old.leaves):
    return None
  out = []
  append = out.append
  plan_of = leaves_lib.LeafPlan
  for lp, x, sig, kind, inline, key in zip(
      old.leaves, leaves, template.signatures, template.types,
      template.inline, template.keys):
    if kind is not None and type(x) is kind:  # a jax.Array, as cached
      sharding = x.sharding  # (the same object, most often: no __eq__)
      if x.shape != sig[1] or x.dtype != sig[2] or (
          sharding is not sig[3] and sharding != sig[3]):
        return None
    elif _signature(x) != sig:
      return None
    if inline:
      got = leaves_lib.inline_leaf(lp.parts, x, options)
      if got is None:  # the signature decides this: a bug if it differs
        raise AssertionError(f"leaf {tree.path_str(lp.parts)!r}: the cached "
                             "plan stored it inline, the new one would not")
      append(got)
      continue
    if key:  # stored as its key data, as plan_save does
      _, x = leaves_lib.key_data(tree.path_str(lp.parts), x)
    append(plan_of(lp.parts, x, lp.entry, lp.layout))
  return leaves_lib.SavePlan(old.structure, out, old.writes, old.options,
                             memo=old.memo)
