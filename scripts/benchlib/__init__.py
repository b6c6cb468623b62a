"""The benchmarks' library: one way to measure, one set of systems.

- ``measure``: wall and CPU seconds and the extra peak RSS of a block;
- ``presets``: the random states of ``configs/*.json`` and their meshes;
- ``systems``: ckpt, Orbax, and the plain-file limits ``raw`` and ``rawpack``;
- ``workers``: fresh worker processes that build a state once and run ops;
- ``report``: medians with their spread, tables, the JSON report.

It imports ckpt, jax and numpy; never another benchmark file.
"""
