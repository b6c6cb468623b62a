"""The hostile-checkpoint benchmark of docs/untrusted.md ("Reading untrusted
checkpoints"): what each hostile file costs a reader.

    python -m scripts.untrusted [--preset full|smoke] [--dir DIR]

builds the hostile files (cases.py), then reads each in a fresh process
(case.py) and decodes an index of each dense item at the cap (dense.py), and
prints one line per case: wall and CPU seconds, growth of peak RSS
(scripts/benchlib/measure.py), and what the call returned or raised.
"""
