"""An oversized index on a bucket is refused before it is read (a one-byte
ranged read past the limit), on both servers; a normal one still reads."""

from __future__ import annotations

import numpy as np
import pytest

import ckpt
from ckpt.store import storage as storage_lib
from ckpt.format import entries
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


# ---- a leaf's relative path cannot leave the checkpoint on a bucket ----------

def _edit_index(url: str, step: str, fn) -> None:
  """Rewrites the index of ``step`` under ``url`` through ``fn(doc)`` (its
  leaves as version 1's maps, written back as today's columns)."""
  from ckpt.format import index_codec  # pylint: disable=g-import-not-at-top
  from tests import sealed  # pylint: disable=g-import-not-at-top
  key = f"{step}/index.msgpack"
  doc = sealed.unpackb(storeutil.read_key(url, key), raw=False)
  doc["leaves"] = index_codec.rows(doc["leaves"])
  fn(doc)
  doc["leaves"] = index_codec.columns(doc["leaves"], entries.KINDS)
  storeutil.write_key(url, key, sealed.packb(doc, use_bin_type=True))


@pytest.mark.parametrize("store", ["s3", "gs"])
def test_a_relpath_out_of_the_checkpoint_is_refused_on_buckets(
    store, s3_bucket, gs_bucket, arrays_only):
  """A victim checkpoint in the same bucket; the run's index points leaf
  ``w`` at the victim's array by a relative path (on s3:// the HTTP layer
  resolves ``/../`` in a request path). Dot segments, empty segments, an
  absolute path and percent escapes of them that ckpt never writes are
  refused when the index is decoded, before any array is opened; ckpt's
  own escapes (``%2E%2E`` of a key "..", ``%2E%2E%2Fvictim`` of a key
  "../victim") are literal names on both stores: nothing there, and never
  the victim's values."""
  del arrays_only
  import posixpath  # pylint: disable=g-import-not-at-top
  bucket = s3_bucket if store == "s3" else gs_bucket
  w = np.arange(4096, dtype=np.float32)
  for name, value in (("run", w), ("victim", -w)):
    with ckpt.Checkpointer(f"{bucket}/{name}", format="zarr") as c:
      c.save(1, {"w": value})
  steps = {name: ckpt.commit.steps.step_dir(
      storage_lib.Storage(f"{bucket}/{name}"), 1) for name in ("run",
                                                               "victim")}
  up = posixpath.relpath(f"victim/{steps['victim']}/w", f"run/{steps['run']}")
  assert up.startswith("../") and up.count("..") >= 2, up
  refused = [up, f"./{up}", up.replace("/", "//", 1), "/victim/w",
             up.replace("..", "%2e%2e"), up.replace("../", "..%2F")]
  literal = [up.replace("..", "%2E%2E"), up.replace("../", "%2E%2E%2F")]
  for relpath in refused + literal:
    def point(doc, relpath=relpath):
      (entry,) = [e for e in doc["leaves"] if e["path"] == ["w"]]
      entry.update(relpath=relpath, checksums=[])
    _edit_index(f"{bucket}/run", steps["run"], point)
    with pytest.raises(ckpt.CheckpointError) as e:
      got = ckpt.load(f"{bucket}/run")
      assert got["w"][1] != -1, f"{relpath!r} read the victim's array"
    if relpath in refused:
      assert isinstance(e.value, ckpt.CorruptCheckpointError), e.value
      assert "not a plain relative path" in str(e.value), e.value
    else:  # ckpt's own escape: a literal, missing name
      assert "%2E%2E" in str(e.value), e.value
