"""Shared helpers of the documentation tests: the repository's Markdown and its code blocks."""

import os
import re

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO_ROOT, "docs")

# Pages written on other branches: listed in mkdocs.yml's nav, absent until the lead merges them.
PENDING_PAGES = set()

_FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ ]*$",
                    re.S | re.M)
_NO_RUN = re.compile(r"<!--\s*no-run:\s*(?P<reason>[^>]+?)\s*-->\s*$")


def read(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


def python_blocks(text):
  """[(line, code, no_run_reason or None)] of the ```python blocks of a Markdown text.

  A block preceded (on the line before its fence) by `<!-- no-run: reason -->` is returned
  with its reason: the caller decides (the guides' test refuses a marker without a reason).
  """
  blocks = []
  for m in _FENCE.finditer(text):
    if m.group("info").strip().split(" ")[0] not in ("python", "py"):
      continue
    before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
    marker = _NO_RUN.search(before)
    line = text[:m.start()].count("\n") + 1
    body = "\n".join(l[len(m.group("indent")):] for l in m.group("body").split("\n"))
    blocks.append((line, body, marker.group("reason") if marker else None))
  return blocks


def guide_pages():
  """Markdown pages whose code blocks must run: getting started, guides, migration, design."""
  pages = [os.path.join(DOCS, "getting-started.md"), os.path.join(DOCS, "design.md")]
  for sub in ("guides", "migration", "api"):
    folder = os.path.join(DOCS, sub)
    pages += sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".md"))
  return [p for p in pages if os.path.exists(p)]


def nav_pages(nav):
  """Every page path named in an mkdocs `nav` structure."""
  if isinstance(nav, str):
    return [nav]
  if isinstance(nav, list):
    return [p for item in nav for p in nav_pages(item)]
  if isinstance(nav, dict):
    return [p for v in nav.values() for p in nav_pages(v)]
  return []
