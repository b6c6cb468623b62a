"""The restore's stages: read only the slices each process needs (lazy leaves, read once over
replicas), verify checksums, apply transforms, assemble jax.Arrays on the target shardings.

May import: the wings below it (store, format, shards, multihost, commit); never save, tiers or
cli.
"""
