"""Fixtures: one moto (S3) and one GCS emulator per test session, a fresh
bucket per test, and the standard environment variables that point ckpt at
them (set for the test, restored after it)."""

from __future__ import annotations

import os

import pytest

from ckpt.store import storage as storage_lib

from tests.objectstore import proxy as proxy_lib
from tests.objectstore import servers

@pytest.fixture(scope="session")
def server_logs(tmp_path_factory):
  return str(tmp_path_factory.mktemp("server-logs"))


@pytest.fixture(scope="session")
def s3_server(server_logs):
  server = servers.start_moto(server_logs)
  yield server
  server.stop()


@pytest.fixture(scope="session")
def gcs_server(server_logs):
  server = servers.start_gcs(server_logs)
  yield server
  server.stop()


@pytest.fixture
def restore_environ():
  """Puts os.environ back as it was after the test (ckpt itself may set
  TENSORSTORE_GCS_HTTP_URL from STORAGE_EMULATOR_HOST)."""
  saved = dict(os.environ)
  yield
  os.environ.clear()
  os.environ.update(saved)


@pytest.fixture
def store_env(s3_server, gcs_server, restore_environ):
  """Both servers reachable through the standard variables, as a user sets
  them; returns those variables (for worker processes)."""
  del restore_environ
  env = {**s3_server.env, **gcs_server.env}
  os.environ.update(env)
  return env


@pytest.fixture
def s3_bucket(s3_server, store_env) -> str:
  """``s3://<fresh bucket>``."""
  del store_env
  return servers.new_bucket(s3_server)


@pytest.fixture
def gs_bucket(gcs_server, store_env) -> str:
  """``gs://<fresh bucket>``."""
  del store_env
  return servers.new_bucket(gcs_server)


@pytest.fixture
def proxied(s3_server, restore_environ):
  """A proxy in front of the session's moto and the URL of a fresh bucket
  reached through it (``AWS_ENDPOINT_URL`` names the proxy)."""
  del restore_environ
  target = ("127.0.0.1", int(s3_server.endpoint.rsplit(":", 1)[1]))
  with proxy_lib.Proxy(target) as px:
    os.environ.pop("AWS_ENDPOINT_URL_S3", None)
    os.environ.update(s3_server.env, AWS_ENDPOINT_URL=px.endpoint)
    yield px, f"{servers.new_bucket(s3_server)}/run"


@pytest.fixture
def listed(monkeypatch):
  """Every prefix ckpt lists (Storage.list_keys, which deletion uses too)."""
  prefixes = []
  real = storage_lib.Storage.list_keys

  def spy(self, prefix):
    prefixes.append(prefix)
    return real(self, prefix)
  monkeypatch.setattr(storage_lib.Storage, "list_keys", spy)
  return prefixes
