"""ckpt: sharded, asynchronous, multi-host checkpoints of JAX PyTrees."""

from ckpt.checkpointer import Checkpointer
from ckpt.errors import (BarrierTimeoutError, CheckpointError,
                         CheckpointNotFoundError, CorruptCheckpointError,
                         InvalidStateError, MissingLeavesError,
                         TreeMismatchError)
from ckpt import integrity
from ckpt import transforms
from ckpt.lazy import LazyLeaf
from ckpt.partition import MeshPartitioner
from ckpt.restore import load

__all__ = [
    "Checkpointer", "LazyLeaf", "MeshPartitioner", "integrity", "load", "transforms", "BarrierTimeoutError",
    "CheckpointError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "InvalidStateError", "MissingLeavesError", "TreeMismatchError",
]
__version__ = "0.1.0"
