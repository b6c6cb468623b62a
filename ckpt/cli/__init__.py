"""The `ckpt` command: listing, inspection, integrity checks, garbage collection, conversion to
and from other formats, the Orbax importer.

May import: everything.
"""
