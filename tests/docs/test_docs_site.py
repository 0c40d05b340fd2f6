"""The documentation site builds with warnings as errors, its navigation resolves, and a
headless browser renders three of its pages (home, Keras guide, DPKerasSGDOptimizer).

Skips (with the reason) only when the tool is absent: MkDocs (`pip install -e ".[docs]"`) or
Chromium (`apt-get install chromium`). The guides' code blocks run in
test_guides_code_blocks.py.
"""

import html.parser
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse

import pytest

from . import docs_support as S

# Nightly tier (-m slow): the tests on the built site (one mkdocs build, ~25 s, and
# a headless browser); by default the navigation check (every nav entry a page) stays.
SLOW_CASES = {
    "test_site_builds_strictly_and_every_internal_link_resolves",
    "test_the_dp_optimizer_page_renders_a_row_for_every_dp_argument",
    "test_headless_browser_renders_three_pages"}

HAVE_MKDOCS = all(importlib.util.find_spec(m) for m in ("mkdocs", "material", "mkdocstrings"))
needs_mkdocs = pytest.mark.skipif(
    not HAVE_MKDOCS, reason='MkDocs, Material or mkdocstrings missing: pip install -e ".[docs]"')
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT_PAGES = {"home": "index.html", "keras_guide": "guides/keras/index.html",
                    "api_dp_keras_sgd_optimizer": "api/dp-keras-sgd-optimizer/index.html"}


def _nav():
  import yaml  # pylint: disable=g-import-not-at-top  (installed with mkdocs)

  class _Loader(yaml.SafeLoader):  # mkdocs.yml may hold !!python/name tags: ignore them
    pass
  _Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
  with open(os.path.join(S.REPO_ROOT, "mkdocs.yml"), encoding="utf-8") as f:
    return yaml.load(f, Loader=_Loader)["nav"]  # pylint: disable=no-value-for-parameter


@pytest.fixture(scope="module")
def site():
  if not HAVE_MKDOCS:
    pytest.skip('MkDocs, Material or mkdocstrings missing: pip install -e ".[docs]"')
  out = tempfile.mkdtemp(prefix="tf_dpiter_site_")
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1", TF_CPP_MIN_LOG_LEVEL="2",
             PYTHONPATH=S.REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", out],
                        cwd=S.REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
  yield out
  shutil.rmtree(out, ignore_errors=True)


def _page_dir(md):
  """docs/guides/keras.md -> guides/keras/index.html (mkdocs' directory URLs)."""
  stem = md[:-len(".md")]
  if stem == "index" or stem.endswith("/index"):
    return stem[:-len("index")] + "index.html"
  return f"{stem}/index.html"


class _Links(html.parser.HTMLParser):

  def __init__(self):
    super().__init__()
    self.hrefs = []

  def handle_starttag(self, tag, attrs):
    if tag == "a":
      self.hrefs += [v for k, v in attrs if k == "href" and v]


def test_every_nav_entry_is_a_page_of_the_repository():
  pages = S.nav_pages(_nav()) if HAVE_MKDOCS else []
  if not HAVE_MKDOCS:
    pytest.skip('PyYAML comes with MkDocs: pip install -e ".[docs]"')
  missing = [p for p in pages if not os.path.exists(os.path.join(S.DOCS, p))]
  assert set(missing) <= S.PENDING_PAGES, f"nav names missing pages: {missing}"
  on_disk = {os.path.relpath(os.path.join(d, f), S.DOCS).replace(os.sep, "/")
             for d, _, fs in os.walk(S.DOCS) for f in fs if f.endswith(".md")}
  assert on_disk <= set(pages), f"pages left out of the nav: {on_disk - set(pages)}"


@needs_mkdocs
def test_site_builds_strictly_and_every_internal_link_resolves(site):
  pages = [p for p in S.nav_pages(_nav()) if p not in S.PENDING_PAGES
           or os.path.exists(os.path.join(S.DOCS, p))]
  pending_urls = {_page_dir(p)[:-len("index.html")] for p in S.PENDING_PAGES}
  broken = []
  for md in pages:
    path = os.path.join(site, _page_dir(md))
    assert os.path.exists(path), f"{md} was not built"
    parser = _Links()
    with open(path, encoding="utf-8") as f:
      parser.feed(f.read())
    for href in parser.hrefs:
      url = urllib.parse.urlparse(href)
      if url.scheme or href.startswith(("#", "mailto:")):
        continue
      target = os.path.normpath(os.path.join(os.path.dirname(path), url.path))
      if os.path.isdir(target):
        target = os.path.join(target, "index.html")
      rel = os.path.relpath(target, site).replace(os.sep, "/")
      pending = rel[:-len("index.html")] in pending_urls or rel in S.PENDING_PAGES
      if not os.path.exists(target) and not pending:
        broken.append(f"{md}: {href}")
  assert not broken, f"links that resolve to nothing: {broken[:20]}"


def test_the_dp_optimizer_page_renders_a_row_for_every_dp_argument(site):
  """The user study's page: the constructor's Parameters table has one row per DP argument
  (a docstring row naming several parameters rendered as none of them)."""
  import inspect  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.optimizer import optimizers  # pylint: disable=g-import-not-at-top
  with open(os.path.join(site, SCREENSHOT_PAGES["api_dp_keras_sgd_optimizer"]),
            encoding="utf-8") as f:
    page = f.read()
  start = page.index('doc-section-title">Parameters:')
  table = page[start:page.index("</table>", start)]
  rows = set(re.findall(r"<td>\s*<code>\s*([A-Za-z_]\w*)\s*</code>\s*</td>", table))
  dp_args = [n for n in inspect.signature(optimizers.DPOptimizerBase.__init__).parameters
             if n not in ("self", "args", "kwargs")]
  assert {"l2_norm_clip", "noise_multiplier", "normalize", "seed"} <= set(dp_args)
  assert set(dp_args) <= rows, sorted(set(dp_args) - rows)


@needs_mkdocs
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install -y chromium")
def test_headless_browser_renders_three_pages(site, tmp_path):
  flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync"]
  shots = os.environ.get("TF_DPITER_SCREENSHOT_DIR", str(tmp_path))
  os.makedirs(shots, exist_ok=True)
  for name, page in SCREENSHOT_PAGES.items():
    url = "file://" + os.path.join(site, page)
    profile = tempfile.mkdtemp(prefix="chromium_")
    try:
      # One launch per page both prints the DOM and writes the screenshot.
      png = os.path.join(shots, f"{name}.png")
      dom = subprocess.run([CHROMIUM, *flags, f"--user-data-dir={profile}",
                            "--window-size=1280,1600", "--dump-dom", f"--screenshot={png}", url],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    finally:
      shutil.rmtree(profile, ignore_errors=True)
    # The rendered page has the site navigation and its own content.
    assert 'class="md-nav' in dom and "Getting started" in dom and "API reference" in dom
    if name == "keras_guide":
      assert "DPKerasSGDOptimizer" in dom and "Sampling" in dom
    if name == "api_dp_keras_sgd_optimizer":
      assert "l2_norm_clip" in dom and "noise_multiplier" in dom and "from_budget" in dom
    with open(png, "rb") as f:
      head = f.read(24)
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and (width, height) == (1280, 1600)
    assert os.path.getsize(png) > 20000, f"{name}: the screenshot looks empty"
