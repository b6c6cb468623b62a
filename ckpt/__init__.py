"""ckpt: sharded, asynchronous, multi-host checkpoints of JAX PyTrees."""

from ckpt.checkpointer import Checkpointer
from ckpt.errors import (BarrierTimeoutError, CheckpointError,
                         CheckpointNotFoundError, CorruptCheckpointError,
                         InvalidStateError, MissingLeavesError,
                         OrbaxImportError,
                         StoreTimeoutError, TreeMismatchError,
                         WaitTimeoutError)
from ckpt.cli import integrity
from ckpt.cli.orbax_export import export_orbax
from ckpt.hf.export import export_safetensors
from ckpt.hf.load import load_safetensors
from ckpt.restore import transforms
from ckpt.restore.lazy import LazyLeaf
from ckpt.metadata import Metadata, abstract_target
from ckpt.shards.partition import MeshPartitioner
from ckpt.restore.read import load
from ckpt.tiers.multitier import MultiTierCheckpointer

__all__ = [
    "Checkpointer", "MultiTierCheckpointer", "LazyLeaf", "MeshPartitioner", "Metadata", "abstract_target", "export_orbax", "export_safetensors", "integrity", "load", "load_safetensors", "transforms", "BarrierTimeoutError",
    "CheckpointError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "InvalidStateError", "MissingLeavesError", "OrbaxImportError", "StoreTimeoutError",
    "TreeMismatchError", "WaitTimeoutError",
]
__version__ = "0.1.0"
