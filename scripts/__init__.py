"""ckpt's benchmarks and tools, run from the repository root as modules:

    python -m scripts.bench --preset smoke          # save/restore comparison
    python -m scripts.<name> --help                 # every other benchmark

``scripts/benchlib/`` is their library (measure, presets, systems, workers,
report); each other file is one benchmark or tool whose docstring says how to
run it and what it measures. Running them as modules (not as files) is what
lets them import ``scripts.benchlib`` and ``tests.*`` with no ``sys.path``
edits; ``tests/test_benchmarks*_smoke.py`` run each on a tiny preset.
"""
