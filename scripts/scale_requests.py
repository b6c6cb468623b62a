"""Requests per save and per restore against a real S3 server (moto), as the
number of retained steps and of chunks per step grows.

Part 3 of the scale harness (``scripts/scale.py`` calls ``run(conf)``).
Everything here is single-process: a ``Checkpointer`` with ``keep=None``
(steps accumulate) saves one leaf cut into ``chunks`` chunks (a host numpy
array with a small ``chunk_bytes``) into a fresh bucket of a moto server
started on 127.0.0.1, and the requests each operation sends are counted
from moto's access log, whose lines look like
``"GET /bucket?list-type=2&prefix=... HTTP/1.1" 200``. A LIST is a GET on
the bucket itself (a ``list-type`` or ``prefix`` query); a GET of a key is a
GET.

For each number of chunks C (a fresh bucket) and each number of steps N in
``steps`` (ascending), the bucket is filled to N - 1 committed steps by one
long-lived Checkpointer, and then these operations are measured:

- ``save``: that Checkpointer saves step N (its first save when N = 1).
- ``restore``: a new Checkpointer (a restarted job) restores the latest
  step with no target: discovery, the index, the data.
- ``metrics``: the same new Checkpointer asks ``all_steps()`` and the
  metrics of every step (what best-metric retention reads after a restart).
- ``retention``: another new Checkpointer with ``keep`` larger than the
  number of steps and ``best_metric="loss"`` runs the retention pass that
  follows a save (discovery and every step's metrics; nothing is deleted).
- ``first_save``: the same new Checkpointer saves step N + 1: its first
  save, which also looks for abandoned attempts of crashed jobs.

The ``steps`` column is the number of committed steps when the operation
ran (after it, for a save). Usage::

  python -m scripts.scale_requests [--config configs/scale_requests.json]
      [--json OUT.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "scale_requests.json"
KINDS = ("LIST", "GET", "PUT", "DELETE", "HEAD")
DEFAULTS: dict[str, Any] = {
    "steps": [1, 4, 16],
    "chunks": [8, 64, 512],
    "chunk_bytes": 1024,
    "format": "zarr",
    "operations": ["save", "restore", "metrics", "retention", "first_save"],
}
_LINE_RE = re.compile(r'"([A-Z]+) (\S+) HTTP/[0-9.]+" (\d{3})')
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours non-2xx lines
_OPS = ("save", "restore", "metrics", "retention", "first_save")


# ---- the S3 server -----------------------------------------------------------

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Moto:
  """``python -m moto.server`` on a free port of 127.0.0.1, its stdout and
  stderr (the access log) in ``log_path``."""

  def __init__(self, log_dir: str):
    port = _free_port()
    self.endpoint = f"http://127.0.0.1:{port}"
    self.log_path = os.path.join(log_dir, f"moto-{port}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(self.log_path, "w") as log:
      self.proc = subprocess.Popen(
          [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
           str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)
    self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1",
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_EC2_METADATA_DISABLED": "true"}
    deadline = time.monotonic() + 30
    while True:
      if self.proc.poll() is not None:
        raise RuntimeError(f"moto exited with {self.proc.returncode}: "
                           f"{open(self.log_path).read()[-2000:]}")
      try:
        with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2):
          break
      except urllib.error.HTTPError:
        break
      except OSError:
        if time.monotonic() > deadline:
          self.stop()
          raise RuntimeError(f"moto on {self.endpoint} did not answer in 30 s")
        time.sleep(0.1)

  def create_bucket(self, name: str) -> str:
    req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
    with urllib.request.urlopen(req, timeout=10):
      pass
    return f"s3://{name}"

  def log_size(self) -> int:
    return os.path.getsize(self.log_path)

  def requests_since(self, offset: int, bucket: str) -> collections.Counter:
    """Requests to ``bucket`` logged after ``offset``, by kind."""
    # The server logs a request after answering it: let the last lines land.
    size, stable_since = -1, time.monotonic()
    while time.monotonic() - stable_since < 0.3:
      now = self.log_size()
      if now != size:
        size, stable_since = now, time.monotonic()
      time.sleep(0.05)
    with open(self.log_path, "rb") as f:
      f.seek(offset)
      text = f.read().decode(errors="replace")
    return classify(text, bucket)

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(10)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()


def classify(log_text: str, bucket: str) -> collections.Counter:
  """Counts the requests of an access log to ``bucket`` by kind: LIST (a GET
  of the bucket with a ``list-type``/``prefix`` query), GET, PUT, DELETE,
  HEAD, and OTHER."""
  out: collections.Counter = collections.Counter()
  for m in _LINE_RE.finditer(_ANSI_RE.sub("", log_text)):
    method, target = m.group(1), m.group(2)
    path, _, query = target.partition("?")
    parts = [p for p in path.split("/") if p]
    if not parts or parts[0] != bucket:
      continue
    if method == "GET" and len(parts) == 1 and (
        "list-type" in query or "prefix=" in query):
      out["LIST"] += 1
    elif method in KINDS:
      out[method] += 1
    else:
      out["OTHER"] += 1
  return out


# ---- the measurements ----------------------------------------------------------

def _state(chunks: int, step: int):
  import numpy as np  # pylint: disable=g-import-not-at-top
  # 256 float32 per chunk with chunk_bytes=1024; one small inline leaf too.
  return {"w": np.full(chunks * 256, step, np.float32), "step": np.int64(step)}


def _measure(server: Moto, bucket: str, fn) -> collections.Counter:
  offset = server.log_size()
  fn()
  return server.requests_since(offset, bucket)


def run(conf: dict | None = None) -> list[dict]:
  """One row per (chunks, steps, operation) with the requests by kind.

  ``conf`` keys (all optional): ``steps`` (list of step counts), ``chunks``
  (list of chunk counts), ``chunk_bytes``, ``format``, ``operations`` (a
  subset of save/restore/metrics/retention/first_save).
  """
  conf = {**DEFAULTS, **(conf or {})}
  ops = [o for o in conf["operations"] if o in _OPS]
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import ckpt  # pylint: disable=g-import-not-at-top
  rows: list[dict] = []
  saved_env = dict(os.environ)
  with tempfile.TemporaryDirectory(prefix="scale-requests-") as tmp:
    server = Moto(tmp)
    try:
      os.environ.update(server.env)
      for ci, chunks in enumerate(conf["chunks"]):
        name = f"scale-{os.getpid()}-{ci}"
        url = server.create_bucket(name) + "/run"
        kw = dict(keep=None, async_save=False, format=conf["format"],
                  chunk_bytes=int(conf["chunk_bytes"]))
        writer = ckpt.Checkpointer(url, **kw)
        next_step = 1
        try:
          for n in sorted(int(s) for s in conf["steps"]):
            while next_step < n:  # fill to n - 1 committed steps
              writer.save(next_step, _state(chunks, next_step),
                          metrics={"loss": 1.0 / next_step})
              next_step += 1
            if next_step > n:
              continue  # a previous first_save passed it already
            row = lambda op, c, steps: rows.append(
                {"chunks": chunks, "steps": steps, "op": op,
                 **{k: c.get(k, 0) for k in KINDS},
                 "total": sum(c.values())})
            step = next_step
            c = _measure(server, name, lambda: writer.save(
                step, _state(chunks, step), metrics={"loss": 1.0 / step}))
            next_step += 1
            if "save" in ops:
              row("save", c, step)
            if "retention" in ops:
              with ckpt.Checkpointer(url, keep=1 << 30, best_metric="loss",
                                     **{k: v for k, v in kw.items()
                                        if k != "keep"}) as ranked:
                # What runs on process 0 after each save (finalize.Retention).
                c = _measure(server, name,
                             lambda: ranked._retention.apply(step))  # pylint: disable=protected-access
                row("retention", c, step)
            if not {"restore", "metrics", "first_save"} & set(ops):
              continue
            with ckpt.Checkpointer(url, **kw) as fresh:
              if "restore" in ops:
                got = {}
                c = _measure(server, name, lambda: got.update(fresh.restore()))
                assert int(got["step"]) == step, (got["step"], step)
                row("restore", c, step)
              if "metrics" in ops:
                c = _measure(server, name, lambda: [
                    fresh.metrics(s) for s in fresh.all_steps()])
                row("metrics", c, step)
              if "first_save" in ops:
                s2 = next_step
                c = _measure(server, name, lambda: fresh.save(
                    s2, _state(chunks, s2), metrics={"loss": 1.0 / s2}))
                next_step += 1
                row("first_save", c, s2)
        finally:
          writer.close()
    finally:
      server.stop()
      os.environ.clear()
      os.environ.update(saved_env)
  return rows


def table(rows: list[dict]) -> str:
  head = ["op", "chunks", "steps", *KINDS, "total"]
  lines = ["| " + " | ".join(head) + " |",
           "|" + "|".join("---" for _ in head) + "|"]
  order = {o: i for i, o in enumerate(_OPS)}
  for r in sorted(rows, key=lambda r: (order[r["op"]], r["chunks"],
                                       r["steps"])):
    lines.append("| " + " | ".join(str(r[k]) for k in head) + " |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default=str(DEFAULT_CONFIG),
                 help="JSON file (default: configs/scale_requests.json)")
  p.add_argument("--json", help="also write the rows to this file")
  args = p.parse_args(argv)
  conf = {}
  if args.config and os.path.exists(args.config):
    with open(args.config) as f:
      conf = json.load(f)
    conf = conf.get("requests", conf)  # a scale.py config may nest it
  rows = run(conf)
  print(table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
