"""Real object-store servers on 127.0.0.1, started and stopped by the tests.

- S3: ``moto`` in server mode (``python -m moto.server``).
- GCS: ``gcp-storage-emulator`` through ``tests.objectstore.gcs_emulator``
  (which adds the listing range the emulator lacks; see there).

Each is a child process on a free port, waited for with a deadline, and
stopped (terminate, then kill) by the fixture that started it. ``env`` holds
the standard variables that point a process at the server, so the tests (and
the worker processes they start) configure ckpt exactly as a user would:
``AWS_ENDPOINT_URL`` / ``AWS_REGION`` / AWS credentials for ``s3://``,
``TENSORSTORE_GCS_HTTP_URL`` for ``gs://``. The metadata-server variables
keep the cloud SDKs' credential probes on the loopback interface.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from ckpt.multihost import local_cluster

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Credential probes of TensorStore's AWS and Google auth: never leave 127.0.0.1.
_bucket_ids = itertools.count()
_NO_METADATA = {"AWS_EC2_METADATA_DISABLED": "true",
                "GCE_METADATA_ROOT": "127.0.0.1:9",
                "GCE_METADATA_HOST": "127.0.0.1:9"}


@dataclasses.dataclass
class Server:
  """One running server; ``scheme`` is "s3" or "gs"."""
  scheme: str
  endpoint: str
  env: dict[str, str]
  proc: subprocess.Popen
  log_path: str

  def log(self) -> str:
    with open(self.log_path, errors="replace") as f:
      return f.read()[-4000:]

  def create_bucket(self, name: str) -> str:
    """Creates ``name`` and returns its URL (``s3://name``)."""
    if self.scheme == "s3":
      req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
    else:
      req = urllib.request.Request(
          f"{self.endpoint}/storage/v1/b?project=test",
          data=json.dumps({"name": name}).encode(), method="POST",
          headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
      if r.status >= 300:
        raise RuntimeError(f"creating bucket {name} on {self.endpoint}: "
                           f"HTTP {r.status}")
    return f"{self.scheme}://{name}"

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(STOP_TIMEOUT_S)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()


def _wait_ready(server: Server, probe: str) -> Server:
  deadline = time.monotonic() + START_TIMEOUT_S
  while time.monotonic() < deadline:
    if server.proc.poll() is not None:
      raise RuntimeError(f"{server.scheme} server exited with "
                         f"{server.proc.returncode}:\n{server.log()}")
    try:
      with urllib.request.urlopen(server.endpoint + probe, timeout=2):
        return server
    except urllib.error.HTTPError:
      return server  # it answers
    except OSError:
      time.sleep(0.1)
  server.stop()
  raise RuntimeError(f"{server.scheme} server on {server.endpoint} did not "
                     f"answer within {START_TIMEOUT_S:.0f}s:\n{server.log()}")


def _spawn(args: list[str], log_path: str) -> subprocess.Popen:
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  with open(log_path, "w") as log:  # the child keeps its own descriptor
    return subprocess.Popen([sys.executable, *args], stdout=log,
                            stderr=subprocess.STDOUT, cwd=REPO, env=env)


def start_moto(log_dir: str) -> Server:
  port = local_cluster.free_port()
  endpoint = f"http://127.0.0.1:{port}"
  log_path = os.path.join(log_dir, f"moto-{port}.log")
  proc = _spawn(["-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                log_path)
  env = {"AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1",
         "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
         **_NO_METADATA}
  return _wait_ready(Server("s3", endpoint, env, proc, log_path),
                     "/moto-api/")


def start_gcs(log_dir: str, *, plain: bool = False) -> Server:
  """``plain=True``: the emulator as published, without the listing range."""
  port = local_cluster.free_port()
  endpoint = f"http://127.0.0.1:{port}"
  log_path = os.path.join(log_dir, f"gcs-{port}.log")
  proc = _spawn(["-m", "tests.objectstore.gcs_emulator",
                 *(["--plain"] if plain else []), "start", "--host",
                 "127.0.0.1", "--port", str(port), "--in-memory", "--quiet"],
                log_path)
  env = {"TENSORSTORE_GCS_HTTP_URL": endpoint, **_NO_METADATA}
  return _wait_ready(Server("gs", endpoint, env, proc, log_path),
                     "/storage/v1/b")


def new_bucket(server: Server) -> str:
  """A fresh bucket on ``server``: its URL."""
  return server.create_bucket(f"ckpt-{os.getpid()}-{next(_bucket_ids)}")
