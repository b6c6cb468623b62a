"""URLs, storage_options and the standard environment variables.

The spec tests need no server; the others reach moto or the GCS emulator
only through what a user would set: the environment or storage_options.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import ckpt
from ckpt.store import urls
from tests.objectstore import servers
from tests.objectstore import storeutil

STATE = {"w": np.arange(5000, dtype=np.float32), "n": 3}
AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION",
            "AWS_DEFAULT_REGION")


def spec(url, **opts):
  return urls.kvstore_for_url(url, opts or None)[0]


def test_specs_come_from_the_url(restore_environ, tmp_path, monkeypatch):
  del restore_environ
  for var in AWS_VARS + ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"):
    os.environ.pop(var, None)
  assert spec("s3://bkt/a/b") == {"driver": "s3", "bucket": "bkt",
                                  "path": "a/b/"}
  assert spec("gs://bkt") == {"driver": "gcs", "bucket": "bkt", "path": ""}
  assert spec("memory://x/y") == {"driver": "memory", "path": "x/y/"}
  assert spec(f"file://{tmp_path}/c") == {"driver": "file",
                                          "path": f"{tmp_path}/c/"}
  monkeypatch.chdir(tmp_path)
  assert spec("rel/d") == {"driver": "file", "path": f"{tmp_path}/rel/d/"}
  # Nothing cloud-specific unless the environment or the caller says so.
  assert "endpoint" not in spec("s3://bkt/a")
  assert "TENSORSTORE_GCS_HTTP_URL" not in os.environ


def test_aws_environment_variables(restore_environ):
  del restore_environ
  for var in AWS_VARS:
    os.environ.pop(var, None)
  os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:1"
  os.environ["AWS_DEFAULT_REGION"] = "eu-west-3"
  assert spec("s3://bkt/p") == {"driver": "s3", "bucket": "bkt", "path": "p/",
                                "endpoint": "http://127.0.0.1:1",
                                "aws_region": "eu-west-3"}
  # The service-specific endpoint and AWS_REGION win, as in the AWS SDKs;
  # storage_options win over both.
  os.environ["AWS_ENDPOINT_URL_S3"] = "http://127.0.0.1:2"
  os.environ["AWS_REGION"] = "us-west-2"
  assert spec("s3://bkt/p")["endpoint"] == "http://127.0.0.1:2"
  assert spec("s3://bkt/p")["aws_region"] == "us-west-2"
  got = spec("s3://bkt/p", endpoint="http://127.0.0.1:3", aws_region="x-1")
  assert (got["endpoint"], got["aws_region"]) == ("http://127.0.0.1:3", "x-1")
  # ... and none of it leaks into other stores.
  assert "endpoint" not in spec("gs://bkt/p")


def test_storage_emulator_host_is_mapped(restore_environ):
  del restore_environ
  os.environ.pop("TENSORSTORE_GCS_HTTP_URL", None)
  os.environ["STORAGE_EMULATOR_HOST"] = "127.0.0.1:4443"
  spec("gs://bkt/p")
  assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:4443"
  # An explicit TENSORSTORE_GCS_HTTP_URL is left alone.
  os.environ["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:5555"
  spec("gs://bkt/p")
  assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:4443"


def test_bad_urls_and_options_name_what_is_wrong():
  with pytest.raises(ckpt.CheckpointError, match=r"'s3:///x'.*no bucket"):
    spec("s3:///x")
  with pytest.raises(ckpt.CheckpointError, match=r"unsupported checkpoint URL 'ftp://h/x'"):
    spec("ftp://h/x")
  with pytest.raises(ckpt.CheckpointError,
                     match=r"\['bucket', 'path'\], which come from the URL"):
    spec("s3://bkt/x", path="elsewhere/", bucket="other")
  with pytest.raises(ckpt.CheckpointError,
                     match=r"'s3://bkt/x' is invalid.*endpont"):
    spec("s3://bkt/x", endpont="http://127.0.0.1:1")
  with pytest.raises(ckpt.CheckpointError,
                     match=r"'s3://bkt/x' is invalid.*s3_request_concurency"):
    ckpt.Checkpointer("s3://bkt/x", storage_options={
        "s3_request_concurency": {"limit": 2}})
  with pytest.raises(ckpt.CheckpointError, match="must be a dict"):
    ckpt.Checkpointer("s3://bkt/x", storage_options=["endpoint"])


def test_s3_through_environment_only(s3_bucket):
  url = f"{s3_bucket}/env"
  with ckpt.Checkpointer(url, async_save=False) as ckptr:
    ckptr.save(1, STATE)
  assert ckpt.load(url)["w"].tobytes() == STATE["w"].tobytes()


def test_s3_through_storage_options_only(s3_server, s3_bucket):
  url = f"{s3_bucket}/opts"
  for var in AWS_VARS:
    os.environ.pop(var, None)
  # Request concurrency and retries are TensorStore context resources,
  # given inline in the kvstore spec.
  opts = {"endpoint": s3_server.endpoint, "aws_region": "us-east-1",
          "s3_request_concurrency": {"limit": 4},
          "s3_request_retries": {"max_retries": 3}}
  with ckpt.Checkpointer(url, format="ocdbt", storage_options=opts,
                         async_save=False) as ckptr:
    # They live in the Checkpointer's context, shared by every kvstore it
    # opens (OCDBT merges databases only over one shared base kvstore).
    assert "s3_request_concurrency" not in ckptr.storage.spec
    ckptr.save(1, STATE)
    assert ckptr.all_steps() == [1]
    assert ckptr.restore(1)["w"].tobytes() == STATE["w"].tobytes()
  got = ckpt.load(url, storage_options=opts)
  assert got["w"].tobytes() == STATE["w"].tobytes() and got["n"] == 3
  # storage_options win over a wrong environment.
  os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"
  assert ckpt.load(url, storage_options=opts)["n"] == 3


def test_gcs_through_storage_emulator_host(gcs_server, gs_bucket):
  os.environ.pop("TENSORSTORE_GCS_HTTP_URL")
  os.environ["STORAGE_EMULATOR_HOST"] = gcs_server.endpoint.removeprefix("http://")
  url = f"{gs_bucket}/emulator-host"
  with ckpt.Checkpointer(url, format="zarr3", async_save=False,
                         storage_options={"gcs_request_retries": {
                             "max_retries": 3}}) as ckptr:
    ckptr.save(1, STATE)
  assert ckpt.load(url)["w"].tobytes() == STATE["w"].tobytes()


def test_server_that_ignores_listing_ranges_is_refused(
    server_logs, store_env, tmp_path):
  """The published emulator lists the whole bucket whatever range is asked:
  ckpt must stop before deleting anything through such a listing."""
  del store_env
  plain = servers.start_gcs(server_logs, plain=True)
  try:
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = plain.endpoint
    bucket = servers.new_bucket(plain)
    other = f"{bucket}/other-run"
    storeutil.kvstore(other).write("checkpoint_1/precious", b"keep me").result()
    with ckpt.Checkpointer(f"{bucket}/run", async_save=False,
                           lease_s=1e-3) as ckptr:
      # A save's first listing (of the committed steps, to refuse a step
      # lower than the newest) refuses the server before anything is
      # written ...
      with pytest.raises(ckpt.CheckpointError,
                         match="ignores the listing range"):
        ckptr.save(1, STATE)
      # ... and so does discovery.
      with pytest.raises(ckpt.CheckpointError,
                         match="ignores the listing range"):
        ckptr.all_steps()
    assert storeutil.read_key(other, "checkpoint_1/precious") == b"keep me"
  finally:
    plain.stop()
