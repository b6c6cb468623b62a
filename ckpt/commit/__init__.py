"""What makes a step visible and what deletes it: the commit protocol (rename or marker), its
records, attempt leases, retention and deletion.

May import: ckpt.errors and the wings below it (store, format, shards, multihost).
"""
