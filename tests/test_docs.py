"""The documentation site cannot rot.

- The site (mkdocs.yml, docs/) builds in strict mode: a broken link, a
  missing anchor or a reference to a name that does not exist fails.
- Every ```python block of every page runs, in page order, in one namespace
  per page, on this process's 8 CPU devices, in a temporary directory (the
  absolute paths of the examples, "/ckpts/...", "/tmp/...", "/dev/shm/...",
  are moved under it; "gs://bucket/..." runs against memory://, the bucket
  layout in this process's memory). A page may give hidden setup code in
  `<!-- docs-test: setup ... -->` (what the example assumes exists: a
  train_step, a saved step), and mark a block that cannot run here with
  `<!-- docs-test: skip: <reason> -->` on the line before it.
- Every ```bash block names commands that exist: `ckpt ...` lines parse with
  the command's own parser, `./scripts/X`, `python scripts/X.py --flag` and
  `python -m scripts.X --flag` (the benchmarks) name a script that exists
  and flags it (or scripts/benchlib/, which it imports) defines.
- The API reference lists exactly `ckpt.__all__`, and every public name has
  a docstring; the docstrings point at docs pages, not source files.
- Every page loads docs/stylesheets/extra.css (content at full width,
  tables that fit); `python -m scripts.docs_check` checks the fit in a
  headless browser (not here: it needs chromium).
"""

from __future__ import annotations

import inspect
import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap
import uuid

import pytest

import ckpt

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
LANGUAGES = {"python", "bash", "console", "text", "mermaid"}
_FENCE = re.compile(r"^( *)```(\S*)\n(.*?)^\1```[ \t]*$", re.S | re.M)
_SETUP = re.compile(r"^( *)<!-- docs-test: setup\n(.*?)^\1-->", re.S | re.M)
_SKIP = re.compile(r"<!-- docs-test: skip: (.+?) -->\s*$")


def blocks(page: pathlib.Path) -> list[dict]:
  """The page's fenced blocks and hidden setups, in order."""
  text = page.read_text()
  found = []
  for m in _SETUP.finditer(text):
    found.append({"start": m.start(), "kind": "setup",
                  "code": textwrap.dedent(m.group(2)),
                  "line": text.count("\n", 0, m.start()) + 1})
  for m in _FENCE.finditer(text):
    line = text.count("\n", 0, m.start()) + 1
    before = text[:m.start()].rstrip("\n ").rsplit("\n", 1)[-1]
    skip = _SKIP.search(before)
    found.append({"start": m.start(), "kind": m.group(2),
                  "code": textwrap.dedent(m.group(3)), "line": line,
                  "skip": skip.group(1) if skip else None})
  return sorted(found, key=lambda b: b["start"])


def _where(page, block) -> str:
  return f"{page.relative_to(ROOT)}:{block['line']}"


def test_every_fence_names_its_language():
  for page in PAGES:
    for b in blocks(page):
      if b["kind"] != "setup":
        assert b["kind"] in LANGUAGES, (
            f"{_where(page, b)}: a code block needs one of {sorted(LANGUAGES)} "
            f"after its ``` (found {b['kind']!r}), so the test knows whether "
            "to run it")


def test_skips_are_few_and_say_why():
  skipped = [(_where(p, b), b["skip"]) for p in PAGES for b in blocks(p)
             if b.get("skip")]
  assert len(skipped) <= 3, skipped
  for where, reason in skipped:
    assert len(reason) > 20, (where, reason)


def _rewrite(code: str, tmp: pathlib.Path, bucket: str) -> str:
  subs = {"/ckpts/": f"{tmp}/ckpts/", "/tmp/": f"{tmp}/tmp/",
          "/dev/shm/": f"{tmp}/shm/", "gs://bucket/": f"memory://{bucket}/"}
  return re.sub(r'(?<=["\'])(/ckpts/|/tmp/|/dev/shm/|gs://bucket/)',
                lambda m: subs[m.group(1)], code)


_RUNNABLE = [p for p in PAGES
             if any(b["kind"] == "python" and not b["skip"]
                    for b in blocks(p))]


@pytest.mark.parametrize("page", _RUNNABLE, ids=lambda p: p.name)
def test_python_blocks_run(page, tmp_path, monkeypatch, capsys):
  import jax  # pylint: disable=g-import-not-at-top
  assert jax.device_count() == 8
  monkeypatch.chdir(tmp_path)
  bucket = f"docs-{uuid.uuid4().hex[:8]}"
  namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
  ran = 0
  try:
    for b in blocks(page):
      if b["kind"] not in ("setup", "python") or b.get("skip"):
        continue
      code = _rewrite(b["code"], tmp_path, bucket)
      assert not re.search(r"[\"'](/ckpts/|/tmp/|/dev/shm/|gs://bucket/)",
                           code.replace(str(tmp_path), "TMP")), code
      try:
        exec(compile(code, _where(page, b), "exec"), namespace)  # pylint: disable=exec-used
      except Exception as e:
        raise AssertionError(f"{_where(page, b)} ({b['kind']}) raised "
                             f"{type(e).__name__}: {e}") from e
      ran += b["kind"] == "python"
  finally:
    for value in list(namespace.values()):
      if isinstance(value, (ckpt.Checkpointer, ckpt.MultiTierCheckpointer)):
        value.close()
  assert ran, page


def test_quoted_outputs_match_what_the_blocks_print(tmp_path, monkeypatch,
                                                     capsys):
  """The printed lines the pages quote as comments are what they print."""
  page = DOCS / "changed-model.md"
  test_python_blocks_run(page, tmp_path, monkeypatch, capsys)
  out = capsys.readouterr().out
  for line in ("params/embedding (512, 64) P('x',)",
               "params/layers/w (4, 64, 64) P(None, 'x')",
               "params/norm/scale (64,) P()"):
    assert line in out, out
    assert f"# {line}" in page.read_text()


def _ckpt_parser():
  from ckpt.cli import main as cli  # pylint: disable=g-import-not-at-top
  return cli.build_parser()


def _check_command(words: list[str], where: str):
  if words[0] == "ckpt":
    parser = _ckpt_parser()
    try:
      parser.parse_args(words[1:])
    except SystemExit as e:
      raise AssertionError(f"{where}: `{shlex.join(words)}` does not parse "
                           "with the ckpt command's parser") from e
  elif words[0].startswith("./scripts/") or (
      words[0] == "python" and words[1].startswith("scripts/")) or (
          words[:2] == ["python", "-m"] and words[2].startswith("scripts.")):
    if words[1:2] == ["-m"]:
      script = ROOT / (words[2].replace(".", "/") + ".py")
      if not script.exists():  # a package: -m runs its __main__.py
        script = ROOT / words[2].replace(".", "/") / "__main__.py"
    else:
      script = ROOT / (words[0] if words[0] != "python" else words[1])
    assert script.exists(), f"{where}: {script} does not exist"
    source = script.read_text()
    if words[1:2] == ["-m"]:
      source += "".join(p.read_text()
                        for p in (ROOT / "scripts" / "benchlib").glob("*.py"))
    for w in words:
      if w.startswith("--"):
        flag = w.split("=", 1)[0]
        assert f'"{flag}"' in source, f"{where}: {script.name} has no {flag}"
  elif words[:2] == ["pip", "install"]:
    pass  # an install line: the path or wheel is the reader's
  elif words[:2] == ["python", "-c"]:
    proc = subprocess.run([sys.executable, "-c", words[2]], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, f"{where}: {proc.stderr[-2000:]}"
  else:
    raise AssertionError(f"{where}: no check for `{words[0]}`; add one to "
                         "tests/test_docs.py")


def test_bash_blocks_name_real_commands_and_flags():
  checked = 0
  for page in PAGES + [ROOT / "README.md"]:
    for b in blocks(page):
      if b["kind"] != "bash" or b.get("skip"):
        continue
      for line in b["code"].splitlines():
        words = shlex.split(line, comments=True)
        if words:
          _check_command(words, _where(page, b))
          checked += 1
  assert checked >= 8


def test_the_reference_lists_exactly_the_public_names():
  text = (DOCS / "reference.md").read_text()
  names = re.findall(r"^::: ckpt\.(\w+)$", text, re.M)
  assert sorted(names) == sorted(ckpt.__all__)
  assert len(names) == len(set(names))


def _public_callables():
  """(name, object, kind) of every public name: ckpt.__all__, the public
  functions and classes of its modules, the public methods of its classes
  (properties as "property")."""
  for name in ckpt.__all__:
    obj = getattr(ckpt, name)
    if inspect.ismodule(obj):
      for sub in getattr(obj, "__all__", dir(obj)):
        member = getattr(obj, sub)
        if (not sub.startswith("_") and
            (inspect.isfunction(member) or inspect.isclass(member)) and
            member.__module__ == obj.__name__):
          yield (f"ckpt.{name}.{sub}", member,
                 "class" if inspect.isclass(member) else "function")
    elif inspect.isclass(obj) and issubclass(obj, Exception):
      yield f"ckpt.{name}", obj, "error"
    elif inspect.isclass(obj):
      yield f"ckpt.{name}", obj, "class"
      for attr, member in inspect.getmembers(obj):
        if attr.startswith("_"):
          continue
        static = inspect.getattr_static(obj, attr)
        if isinstance(static, property):
          yield f"ckpt.{name}.{attr}", static.fget, "property"
        elif inspect.isfunction(member):
          yield f"ckpt.{name}.{attr}", member, "function"
    else:
      yield f"ckpt.{name}", obj, "function"


def _docstring_gaps(obj, kind: str) -> list[str]:
  doc = inspect.getdoc(obj) or ""
  if not doc:
    return ["no docstring"]
  if kind in ("error", "property"):
    return []
  target = obj.__init__ if kind == "class" else obj
  if target is object.__init__:  # no constructor of its own
    return [] if "rais" in doc.lower() else ["does not say what it raises"]
  params = [p for p in inspect.signature(target).parameters
            if p not in ("self", "cls")]
  gaps = [f"argument {p!r} not described" for p in params
          if not re.search(rf"\b{re.escape(p.lstrip('*'))}\b", doc)]
  if "rais" not in doc.lower():
    gaps.append("does not say what it raises (or that it never raises)")
  if kind == "function" and "collective" not in doc.lower():
    gaps.append("does not say whether it is collective")
  return gaps


def test_every_public_name_has_a_docstring_with_its_contract():
  """Arguments, what it raises, and whether it is collective."""
  gaps = {n: g for n, obj, kind in _public_callables()
          if (g := _docstring_gaps(obj, kind))}
  assert not gaps, "\n".join(f"{n}: {'; '.join(g)}" for n, g in gaps.items())


def test_the_site_builds_in_strict_mode(tmp_path):
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  proc = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
       str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
      timeout=240, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  reference = (tmp_path / "site" / "reference" / "index.html").read_text()
  for name, _, _ in _public_callables():  # every method too
    assert f'id="{name}"' in reference, name
  # No page asks the network for fonts at build or read time.
  assert "fonts.googleapis.com" not in reference
  # The public docstrings point at docs pages, not at source files.
  text = re.sub(r"<[^>]+>", "", reference)
  assert not re.findall(r"\bckpt/[\w/]+\.py\b", text), sorted(
      set(re.findall(r"\bckpt/[\w/]+\.py\b", text)))
  _check_the_layout_css(tmp_path / "site")


def _check_the_layout_css(site: pathlib.Path):
  """Every page loads docs/stylesheets/extra.css, which widens the content
  (no max-width on .md-grid) and makes tables fit their column. Whether
  they fit in a browser at 1280 px: python -m scripts.docs_check (needs
  chromium, so not part of the suite; docs/design.md)."""
  css = (site / "stylesheets" / "extra.css").read_text()
  grid = re.search(r"\.md-grid\s*\{([^}]*)\}", css)
  assert grid and re.search(r"max-width:\s*(none|100%)", grid.group(1)), css
  assert re.search(r"table:not\(\[class\]\)\s*\{[^}]*display:\s*table",
                   css), css
  pages = [p for p in site.rglob("index.html")
           if p.parent.name not in ("search", "assets")]
  assert len(pages) >= len(PAGES)
  for page in pages:
    assert re.search(r'<link[^>]+href="[./]*stylesheets/extra\.css"',
                     page.read_text()), page


def test_charts_are_drawn_from_the_benchmark_data(tmp_path):
  pytest.importorskip("matplotlib")
  # With no file arguments it reads every file of docs/benchmarks/data.
  proc = subprocess.run(
      [sys.executable, "scripts/charts.py", "--out", str(tmp_path)],
      cwd=ROOT, capture_output=True, text=True, timeout=180)
  assert proc.returncode == 0, proc.stderr[-3000:]
  drawn = sorted(p.name for p in tmp_path.glob("*.svg"))
  checked_in = sorted(p.name for p in (DOCS / "benchmarks").glob("*.svg"))
  assert drawn == checked_in
  for name in drawn:  # every chart is shown on a page
    assert any(f"benchmarks/{name}" in p.read_text() for p in PAGES), name
