"""What is on disk and how it is named: the index (its codec and its validation of untrusted
input), TensorStore specs, PRNG key leaves, tree paths, saved shardings, metrics and host state.

May import: ckpt.errors, ckpt.store.
"""
