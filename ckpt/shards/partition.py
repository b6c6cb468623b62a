"""Which slice of a host numpy leaf this process owns (``partitioner=``).

``jax.Array`` leaves carry their own sharding. Host numpy leaves do not, so a
partitioner says, per leaf, how the global array is laid out over a mesh
(like T5X's ``get_local_chunk_info``): every process holds the whole value
(or at least its slice) and writes only the boxes the plan gives it.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# partitioner(path, shape) -> a Sharding, or None for "replicated".
Partitioner = Callable[[str, tuple[int, ...]], "jax.sharding.Sharding | None"]


class MeshPartitioner:
  """A mesh plus ``(regex, PartitionSpec)`` rules matched against leaf paths.

  The first rule whose regex fully matches the leaf path (``opt/mu/w``) wins;
  a leaf no rule matches is replicated (and its chunks are still spread over
  the processes).

  Args:
    mesh: the mesh the host numpy leaves are split over.
    rules: ``[(regex, PartitionSpec)]``, e.g. ``[(r"data/.*", P("data"))]``.

  Raises ``re.error`` for an invalid regex. Not collective: give every
  process the same partitioner (``Checkpointer(partitioner=...)``).
  """

  def __init__(self, mesh: Mesh,
               rules: Sequence[tuple[str, PartitionSpec]] = ()):
    self.mesh = mesh
    self.rules = [(re.compile(p), spec) for p, spec in rules]

  def __call__(self, path: str, shape: tuple[int, ...]):
    for regex, spec in self.rules:
      if regex.fullmatch(path):
        return NamedSharding(self.mesh, spec)
    return None
