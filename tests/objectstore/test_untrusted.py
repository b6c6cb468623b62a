"""An oversized index on a bucket is refused before it is read (a one-byte
ranged read past the limit), on both servers; a normal one still reads."""

from __future__ import annotations

import numpy as np
import pytest

import ckpt
from ckpt.store import storage as storage_lib
from tests.objectstore import storeutil


@pytest.mark.parametrize("store", ["s3", "gs"])
def test_oversized_index_is_refused_before_reading(store, s3_bucket,
                                                   gs_bucket, monkeypatch):
  url = f"{s3_bucket if store == 's3' else gs_bucket}/run"
  state = {"w": np.arange(100, dtype=np.float32), "n": 3}
  with ckpt.Checkpointer(url, format="zarr") as c:
    c.save(1, state)
  assert ckpt.load(url)["w"].tolist() == state["w"].tolist()
  storage = storage_lib.Storage(url)
  step = ckpt.commit.steps.step_dir(storage, 1)
  size = len(storeutil.read_key(url, f"{step}/index.msgpack"))
  # Exactly at the limit: read; one byte over: refused, without reading.
  assert storage.read_bytes(f"{step}/index.msgpack", limit=size)
  reads = []
  real_read = storage.kv.read
  monkeypatch.setattr(storage, "_kv", _Spy(storage.kv, reads))
  with pytest.raises(ckpt.CorruptCheckpointError, match="over the"):
    storage.read_bytes(f"{step}/index.msgpack", limit=size - 1)
  assert reads == [slice(size - 1, size)], reads
  del real_read


class _Spy:
  """A kvstore whose reads record their byte ranges."""

  def __init__(self, kv, reads):
    self._kv, self._reads = kv, reads

  def read(self, key, byte_range=None, **kw):
    self._reads.append(byte_range)
    return self._kv.read(key, byte_range=byte_range, **kw)
