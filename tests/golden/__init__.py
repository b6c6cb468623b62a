"""Golden checkpoints of every index format version (see make_golden.py)."""
