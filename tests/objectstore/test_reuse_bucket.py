"""reuse_unchanged=True on buckets (S3 and GCS emulators): a bucket has no
links, so every chunk is written (docs/format.md, "Reusing unchanged
chunks", for the server-side-copy design); saves, retention and verify work
as without it."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli import integrity


@pytest.mark.parametrize("bucket", ["s3_bucket", "gs_bucket"])
def test_reuse_on_a_bucket_writes_everything(bucket, request):
  url = request.getfixturevalue(bucket) + "/run"
  mesh = Mesh(np.array(jax.devices()).reshape(8), ("x",))
  frozen = np.random.default_rng(0).standard_normal((256, 256), np.float32)
  sh = NamedSharding(mesh, P("x"))
  with ckpt.Checkpointer(url, keep=1, reuse_unchanged=True, async_save=False,
                         chunk_bytes=32 << 10) as c:
    for step in range(2):
      train = np.random.default_rng([1, step]).standard_normal(
          (128, 256), np.float32)
      c.save(step, {"frozen": jax.device_put(frozen, sh),
                    "train": jax.device_put(train, sh)})
      assert c.last_save_stats.bytes_reused == 0
      assert c.last_save_stats.bytes_written == frozen.nbytes + train.nbytes
    assert c.all_steps() == [1]
  assert ckpt.load(url, 1)["frozen"].tobytes() == frozen.tobytes()
  assert integrity.verify(url, step=1) == []
