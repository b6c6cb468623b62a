"""Checks the built documentation site in a real headless browser.

Usage (from the repository root, after ``./scripts/docs build``):
  python -m scripts.docs_check [--site out/site] [--width 1280]
      [--screenshots DIR] [--shoot benchmarks/ reference/ ...]
      [--chromium chromium]

Serves the built site on 127.0.0.1 and loads every page, at ``--width``
pixels (default 1280), in headless Chromium (Debian's ``chromium``; not
installed in CI, so this is not part of the test suite). Each page is
loaded in a same-origin iframe of that width by a small wrapper page that
measures, once the page has loaded, whether the page scrolls sideways
(``scrollWidth`` against ``clientWidth`` of the document), and for every
table and every ``text`` block (a benchmark script's table) whether it
scrolls sideways or sticks out of the content column; Chromium prints the
wrapper's DOM with the results (``--dump-dom``). Other code blocks that
scroll are reported, not failed. ``--screenshots DIR`` also saves a
screenshot of the whole of each page named by ``--shoot`` (its path in the
site), at ``--width``, cut into ``--width`` x 900 tiles where Pillow is
installed.

Exits 1 if any page or table does not fit.
"""

from __future__ import annotations

import argparse
import functools
import html
import http.server
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import urllib.parse

ROOT = pathlib.Path(__file__).resolve().parents[1]
WRAPPER = "/__docs_check__.html"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--hide-scrollbars"]

# Runs in the wrapper: loads the page in an iframe of the width asked for,
# measures it and writes the results as JSON into <pre id="result">.
_SCRIPT = r"""
const params = new URLSearchParams(location.search);
const frame = document.createElement('iframe');
frame.style.cssText = `border:0;width:${params.get('width')}px;height:900px`;
frame.src = params.get('page');
frame.onload = () => setTimeout(() => {
  const doc = frame.contentDocument, el = doc.documentElement;
  const column = doc.querySelector('.md-content__inner') || doc.body;
  const right = column.getBoundingClientRect().right + 0.5;
  const wide = (e) => ({scroll: e.scrollWidth, client: e.clientWidth,
                        right: Math.round(e.getBoundingClientRect().right)});
  const tables = [...doc.querySelectorAll('.md-typeset table')].map((t, i) => {
    const wrap = t.closest('.md-typeset__scrollwrap') || t;
    const w = wide(t), s = wide(wrap);
    return {i, columns: t.rows[0] ? t.rows[0].cells.length : 0,
            head: (t.rows[0] ? t.rows[0].innerText : '').slice(0, 60),
            table: w, wrap: s,
            fits: w.scroll <= w.client + 1 && s.scroll <= s.client + 1 &&
                  w.right <= right};
  });
  const blocks = [...doc.querySelectorAll('.md-typeset pre > code')].map(
      (c, i) => {
    const pre = c.parentElement, w = wide(c);  // material scrolls the code
    const text = !!pre.closest('.language-text');
    return {i, text, head: c.innerText.split('\n')[0].slice(0, 60), pre: w,
            fits: w.scroll <= w.client + 1 && w.right <= right};
  });
  const out = {page: params.get('page'), width: frame.contentWindow.innerWidth,
               doc: {scroll: el.scrollWidth, client: el.clientWidth,
                     height: el.scrollHeight},
               column: Math.round(column.getBoundingClientRect().width),
               tables, blocks};
  document.getElementById('result').textContent = JSON.stringify(out);
}, 300);
document.body.appendChild(frame);
"""

_PAGE = ("<!doctype html><html><head><meta charset='utf-8'></head>"
         "<body style='margin:0'><pre id='result'></pre><script>"
         + _SCRIPT + "</script></body></html>")


class _Handler(http.server.SimpleHTTPRequestHandler):

  def do_GET(self):  # noqa: N802 (the base class's name)
    if self.path.startswith(WRAPPER):
      body = _PAGE.encode()
      self.send_response(200)
      self.send_header("Content-Type", "text/html; charset=utf-8")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)
      return
    super().do_GET()

  def log_message(self, *args):  # quiet
    pass


def serve(site: pathlib.Path) -> tuple[http.server.ThreadingHTTPServer, str]:
  handler = functools.partial(_Handler, directory=str(site))
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  return server, f"http://127.0.0.1:{server.server_address[1]}"


def pages(site: pathlib.Path) -> list[str]:
  found = []
  for index in sorted(site.rglob("index.html")):
    rel = index.parent.relative_to(site).as_posix()
    if not rel.startswith(("assets", "search")):
      found.append("" if rel == "." else rel + "/")
  return found


def measure(chromium: str, base: str, page: str, width: int,
            profile: str) -> dict:
  query = urllib.parse.urlencode({"page": "/" + page, "width": width})
  cmd = [chromium, *FLAGS, f"--user-data-dir={profile}",
         f"--window-size={width + 40},900", "--virtual-time-budget=15000",
         "--run-all-compositor-stages-before-draw", "--dump-dom",
         f"{base}{WRAPPER}?{query}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  m = re.search(r'<pre id="result">(.*?)</pre>', proc.stdout, re.S)
  if not m or not m.group(1).strip():
    raise RuntimeError(f"{page}: no result from chromium "
                       f"(rc {proc.returncode}): {proc.stderr[-2000:]}")
  return json.loads(html.unescape(m.group(1)))


def screenshot(chromium: str, base: str, page: str, width: int, height: int,
               out: pathlib.Path, profile: str) -> list[pathlib.Path]:
  """The whole page at ``width`` (a window as tall as the page), and, where
  Pillow is installed, that image cut into ``width`` x 900 tiles."""
  height = max(900, min(height, 16000))
  cmd = [chromium, *FLAGS, f"--user-data-dir={profile}",
         f"--window-size={width},{height}", "--virtual-time-budget=15000",
         "--run-all-compositor-stages-before-draw",
         f"--screenshot={out}", f"{base}/{page}"]
  subprocess.run(cmd, capture_output=True, timeout=120, check=True)
  try:
    from PIL import Image  # pylint: disable=g-import-not-at-top
  except ImportError:
    return [out]
  tiles = []
  with Image.open(out) as im:
    for n, top in enumerate(range(0, im.height, 900)):
      tile = out.with_name(f"{out.stem}-{n}.png")
      im.crop((0, top, im.width, min(top + 900, im.height))).save(tile)
      tiles.append(tile)
  return [out, *tiles]


def report(r: dict) -> tuple[bool, list[str]]:
  lines, ok = [], True
  d = r["doc"]
  page_fits = d["scroll"] <= d["client"]
  ok &= page_fits
  bad_tables = [t for t in r["tables"] if not t["fits"]]
  bad_text = [b for b in r["blocks"] if b["text"] and not b["fits"]]
  bad_code = [b for b in r["blocks"] if not b["text"] and not b["fits"]]
  ok &= not bad_tables and not bad_text
  lines.append(
      f"{'ok  ' if ok else 'FAIL'} /{r['page'].lstrip('/'):<22} page "
      f"{d['scroll']}/{d['client']} px, column {r['column']} px, "
      f"tables {len(r['tables']) - len(bad_tables)}/{len(r['tables'])} fit, "
      f"text blocks {sum(b['text'] and b['fits'] for b in r['blocks'])}/"
      f"{sum(b['text'] for b in r['blocks'])} fit, "
      f"other code blocks scrolling: {len(bad_code)}")
  for t in bad_tables:
    lines.append(f"       table {t['i']} ({t['columns']} columns, "
                 f"{t['head']!r}): scrollWidth/clientWidth "
                 f"{t['table']['scroll']}/{t['table']['client']}, its "
                 f"scroll box {t['wrap']['scroll']}/{t['wrap']['client']}, "
                 f"right edge {t['table']['right']} px")
  for b in bad_text + bad_code:
    lines.append(f"       {'text' if b['text'] else 'code'} block {b['i']} "
                 f"({b['head']!r}): scrollWidth {b['pre']['scroll']} > "
                 f"clientWidth {b['pre']['client']}")
  return ok, lines


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--site", default=str(ROOT / "out" / "site"),
                  help="the built site (./scripts/docs build)")
  ap.add_argument("--width", type=int, default=1280)
  ap.add_argument("--chromium", default="chromium")
  ap.add_argument("--screenshots", default=None,
                  help="a folder for screenshots of the --shoot pages")
  ap.add_argument("--shoot", nargs="*",
                  default=["benchmarks/", "reference/", "at-scale/"],
                  help="pages to screenshot, e.g. benchmarks/")
  ap.add_argument("--json", default=None, help="also write the results")
  args = ap.parse_args(argv)
  site = pathlib.Path(args.site)
  if not (site / "index.html").is_file():
    print(f"no site in {site}: run ./scripts/docs build first",
          file=sys.stderr)
    return 2
  server, base = serve(site)
  results, ok = [], True
  try:
    with tempfile.TemporaryDirectory() as profile:
      for page in pages(site):
        r = measure(args.chromium, base, page, args.width, profile)
        results.append(r)
        page_ok, lines = report(r)
        ok &= page_ok
        print("\n".join(lines), flush=True)
      if args.screenshots:
        folder = pathlib.Path(args.screenshots)
        folder.mkdir(parents=True, exist_ok=True)
        heights = {r["page"].strip("/"): r["doc"]["height"] for r in results}
        for page in args.shoot:
          name = re.sub(r"[^A-Za-z0-9_-]+", "_", page.strip("/")) or "index"
          out = folder / f"{name}-{args.width}.png"
          files = screenshot(args.chromium, base, page, args.width,
                             heights.get(page.strip("/"), 900), out, profile)
          print(f"screenshots {files[0]} ({len(files) - 1} tiles)")
  finally:
    server.shutdown()
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
  print("all pages fit" if ok else "some pages do not fit", flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
