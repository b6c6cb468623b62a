"""How an array is cut: boxes and shards, where a sharding places them (placement), which
process writes which chunk (plan), tiling digests, the partitioner for host arrays. Pure: no I/O.

May import: ckpt.errors, ckpt.store, ckpt.format.
"""
