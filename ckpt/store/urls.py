"""A checkpoint URL (a path, file://, gs://, s3://, memory://) made into the TensorStore kvstore
spec of its directory: ``storage_options`` merged in as they are (but never the members the URL
decides), the AWS and GCS emulator environment variables applied, and the spec checked by
TensorStore before anything opens it.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Any

import tensorstore as ts

from ckpt.errors import CheckpointError

# Members of the kvstore spec that the URL decides; storage_options may not.
_FROM_URL = ("driver", "bucket", "path")
# TensorStore reads its GCS endpoint from this variable (no spec member).
_GCS_HTTP_URL = "TENSORSTORE_GCS_HTTP_URL"


def _env_s3_options() -> dict[str, Any]:
  """The endpoint and region the AWS environment variables ask for."""
  out: dict[str, Any] = {}
  endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3")
              or os.environ.get("AWS_ENDPOINT_URL"))
  if endpoint:
    out["endpoint"] = endpoint
  region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
  if region:
    out["aws_region"] = region
  if (os.environ.get("AWS_ACCESS_KEY_ID") and
      os.environ.get("AWS_SECRET_ACCESS_KEY") and
      not os.environ.get("CKPT_DEBUG")):
    # The credentials come from the environment, which the default chain
    # reads first anyway: reading them alone spares every process the AWS
    # SDK's native ERROR lines about a missing ~/.aws/config (10 per
    # Checkpointer). storage_options' aws_credentials wins.
    out["aws_credentials"] = {"type": "environment"}
  return out


def _apply_gcs_emulator_env() -> None:
  """Points TensorStore at ``STORAGE_EMULATOR_HOST`` (the Google client
  libraries' variable) unless ``TENSORSTORE_GCS_HTTP_URL`` is set already.

  TensorStore reads its variable when a gcs kvstore opens, so setting it in
  this process's environment is how the endpoint gets there.
  """
  host = os.environ.get("STORAGE_EMULATOR_HOST")
  if host and not os.environ.get(_GCS_HTTP_URL):
    os.environ[_GCS_HTTP_URL] = host if "://" in host else f"http://{host}"


def kvstore_for_url(url: str, storage_options: dict | None = None
                    ) -> tuple[dict[str, Any], bool]:
  """(kvstore spec of the directory, whether it is a local file system)."""
  url = os.fspath(url)
  if storage_options is not None and not isinstance(storage_options, dict):
    raise CheckpointError(
        f"storage_options for {url!r} must be a dict merged into the "
        f"TensorStore kvstore spec, got {type(storage_options).__name__}")
  opts = dict(storage_options or {})
  taken = sorted(k for k in opts if k in _FROM_URL)
  if taken:
    raise CheckpointError(
        f"storage_options for {url!r} set {taken}, which come from the URL; "
        f"put them in the URL instead (storage_options has {sorted(opts)})")
  parsed = urllib.parse.urlparse(url)
  scheme = parsed.scheme if len(parsed.scheme) > 1 else ""  # C:\ on Windows
  if scheme in ("", "file"):
    path = parsed.path if scheme == "file" else url
    spec = {"driver": "file", "path": os.path.abspath(path).rstrip("/") + "/"}
    return _checked({**spec, **opts}, url, opts), True
  path = parsed.path.strip("/")
  path = path + "/" if path else ""
  if scheme in ("gs", "s3") and not parsed.netloc:
    raise CheckpointError(
        f"checkpoint URL {url!r} names no bucket; expected {scheme}://BUCKET/DIR")
  if scheme == "gs":
    _apply_gcs_emulator_env()
    spec = {"driver": "gcs", "bucket": parsed.netloc, "path": path}
  elif scheme == "s3":
    spec = {"driver": "s3", "bucket": parsed.netloc, "path": path,
            **_env_s3_options()}
  elif scheme == "memory":
    spec = {"driver": "memory", "path": (parsed.netloc + "/" + path).strip("/") + "/"}
  else:
    raise CheckpointError(
        f"unsupported checkpoint URL {url!r}: expected a path, file://, "
        "gs://, s3:// or memory://")
  return _checked({**spec, **opts}, url, opts), False


def _checked(spec: dict[str, Any], url: str, opts: dict) -> dict[str, Any]:
  """The spec, after TensorStore has parsed it (unknown options fail here)."""
  try:
    ts.KvStore.Spec(spec)
  except Exception as e:  # ValueError from TensorStore's JSON binding
    raise CheckpointError(
        f"the kvstore spec for {url!r} is invalid: {e}. storage_options was "
        f"{opts}; see TensorStore's documentation of the {spec['driver']!r} "
        "kvstore driver for the members it accepts") from e
  return spec


def join(spec: dict[str, Any], rel: str) -> dict[str, Any]:
  """The kvstore spec of ``rel`` (a relative directory) under ``spec``."""
  rel = rel.strip("/")
  return {**spec, "path": spec["path"] + (rel + "/" if rel else "")}
