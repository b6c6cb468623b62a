"""Issue 45 item 7: with the AWS credentials in the environment, a job
that saves to S3 printed 10 native ERROR lines of the AWS SDK per
Checkpointer (``AuthCredentialsProvider ... Failed to open file
'~/.aws/config'``), which the CLI hid and the library did not. A fresh
process (its own stderr, no ~/.aws) saves and restores on moto: nothing on
stderr; ``CKPT_DEBUG=1`` keeps the SDK's default chain and its lines."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.objectstore import servers

_JOB = """
import numpy as np, ckpt
with ckpt.Checkpointer({url!r}, async_save=False) as c:
  c.save(1, {{"w": np.arange(8.0)}})
  assert (c.restore(1)["w"] == np.arange(8.0)).all()
print("ok")
"""


@pytest.mark.parametrize("debug", [False, True])
def test_no_native_lines_unless_ckpt_debug(s3_server, tmp_path, debug):
  url = f"{servers.new_bucket(s3_server)}/run"
  env = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
  env.update(s3_server.env, HOME=str(tmp_path))  # no ~/.aws there
  if debug:
    env["CKPT_DEBUG"] = "1"
  r = subprocess.run([sys.executable, "-c", _JOB.format(url=url)], env=env,
                     capture_output=True, text=True, timeout=120,
                     cwd=servers.REPO)
  assert r.stdout.strip() == "ok", r.stderr[-3000:]
  native = [l for l in r.stderr.splitlines()
            if "AuthCredentialsProvider" in l or "Failed to open file" in l]
  if debug:
    assert native, r.stderr[-3000:]
  else:
    assert not native and not r.stderr.strip(), r.stderr[-3000:]
