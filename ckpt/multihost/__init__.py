"""Processes that act as one job: process identity, barriers, agreement rounds (one decision
for all processes, or one error on all), and the local cluster of real processes on 127.0.0.1.

May import: ckpt.errors, ckpt.store, ckpt.format, ckpt.shards.
"""
