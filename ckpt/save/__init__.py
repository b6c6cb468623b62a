"""The save's stages after the caller's: plan each leaf, stage it off the devices, write the
owned chunks under one byte budget, and the runner that takes an attempt through barriers,
index and commit.

May import: the wings below it (store, format, shards, multihost, commit); never restore, tiers
or cli.
"""
