"""The parts of the public classes (ckpt/checkpointer.py's ``Checkpointer``, and through
it tiers/multitier.py's): the background loop, the save in flight, what process 0 knows of
the committed steps, the agreement rounds, the save, the restore and the queries; parts.py
builds and wires them once, and tier_side.py is what a MultiTierCheckpointer asks of its
persistent tier. Each part creates its fields in its own ``__init__`` and is used through its
public methods.

May import: the wings below it (store, format, shards, multihost, commit, save, restore) and
ckpt.errors; never the public classes (ckpt.checkpointer), tiers or cli.
"""
