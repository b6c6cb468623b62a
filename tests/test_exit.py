"""A job that exits without close() still commits its last async save."""

import subprocess
import sys
import textwrap

import numpy as np

import ckpt

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import ckpt
    c = ckpt.Checkpointer(sys.argv[1])  # async_save=True, never closed
    c.save(1, {"w": np.random.default_rng(0).standard_normal((2048, 1024),
                                                            dtype=np.float32)})
""")


def test_async_save_is_committed_at_interpreter_exit(tmp_path):
  out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "did not finish" not in out.stderr, out.stderr
  want = np.random.default_rng(0).standard_normal((2048, 1024), dtype=np.float32)
  assert np.array_equal(ckpt.load(tmp_path)["w"], want)
  assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_1"]
