"""writer="process" with reuse_unchanged=True on a bucket (the real S3
server, moto, on loopback): refused at construction with the reason (the
leaves held by an earlier step need a round through jax.distributed,
which writer processes do not join); nothing is written."""

from __future__ import annotations

import pytest

import ckpt


def test_reuse_on_a_bucket_is_refused_with_the_writer_process(s3_bucket):
  with pytest.raises(ValueError, match=r"reuse_unchanged=True cannot save to "
                     r"'s3://.*': on a bucket unchanged leaves are held by an "
                     r"earlier step .* through jax.distributed"):
    ckpt.Checkpointer(f"{s3_bucket}/w", writer="process",
                      reuse_unchanged=True)
  with ckpt.Checkpointer(f"{s3_bucket}/w", writer="process") as c:
    assert c.all_steps() == []
