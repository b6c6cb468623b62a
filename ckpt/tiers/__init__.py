"""Multi-tier checkpoints: a local tier on each host's disk with a replica on a partner host,
and the persistent tier (a Checkpointer) for the bucket, with one timeline across both.

May import: everything but cli.
"""
