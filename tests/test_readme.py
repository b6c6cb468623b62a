"""The README's first steps work as written: the Quickstart runs on 1, 3
and 8 devices (a laptop has one), and the package installs by the name
the README gives, with one version everywhere."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import ckpt

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _quickstart() -> str:
  section = README.split("## Quickstart\n", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 1, "the Quickstart has one python block"
  return blocks[0]


@pytest.mark.parametrize("devices", [1, 3, 8])
def test_quickstart_runs_on_any_device_count(devices, tmp_path):
  code = _quickstart()
  assert code.count('"/tmp/run1"') == 2
  code = code.replace('"/tmp/run1"', repr(str(tmp_path / "run1")))
  code += ("\nimport numpy as np\n"
           "assert jax.device_count() == %d\n"
           "assert isinstance(restored['params']['w'], jax.Array)\n"
           "assert np.array_equal(restored['params']['w'], np.ones((960, 480)))\n"
           "assert restored['step'] == 100 and host['step'] == 100\n"
           "print('quickstart ok')\n" % devices)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=180)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "quickstart ok" in proc.stdout
  assert "100 [100] {'loss': 1.25}" in proc.stdout


def test_the_distribution_name_and_version_are_one():
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  pyproject = (ROOT / "pyproject.toml").read_text()
  assert re.search(r'^name = "ckpt-jax"$', pyproject, re.M)
  assert 'version = {attr = "ckpt.__version__"}' in pyproject
  # Every pip command in the README names this distribution, never `ckpt`
  # (an unrelated project on PyPI).
  for cmd in re.findall(r"pip install [^\n`]*", README):
    assert not re.search(r"(^|[\s'\"])ckpt(\[|[\s'\"]|$)", cmd[12:]), cmd
  try:
    installed = metadata.version("ckpt-jax")
  except metadata.PackageNotFoundError:
    pytest.skip("ckpt-jax is not pip-installed here (pip install -e .)")
  assert installed == ckpt.__version__


def test_the_readme_is_short_and_opens_with_the_two_commands():
  lines = README.splitlines()
  assert len(lines) <= 150, len(lines)
  first_block = README.split("```bash\n", 1)[1].split("```", 1)[0]
  assert [l.split()[0] for l in first_block.splitlines()] == [
      "./scripts/demo", "./scripts/test"]
  assert README.index("```bash") < README.index("\n## ")
  assert len(_quickstart().strip().splitlines()) <= 20


def test_the_readme_links_to_pages_that_exist():
  links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README)
  assert len(links) >= 15
  for link in links:
    assert (ROOT / link).is_file(), link


def test_the_readme_lists_every_page_of_the_site():
  """Issue 45 item 8: the README's list of pages missed the Flax page."""
  nav = re.findall(r"^  - [^:]+: ([\w-]+\.md)$",
                   (ROOT / "mkdocs.yml").read_text(), re.M)
  assert "flax.md" in nav
  listed = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", README))
  missing = [p for p in nav if p != "index.md" and p not in listed]
  assert not missing, missing
