"""Every `dp.` name the README and the documentation mention resolves, and every public name
of every namespace appears on its API page."""

import ast
import importlib
import os
import re

import pytest

import tf_dpiter
from . import api_pages
from . import docs_support as S

_NAME = re.compile(r"(?<![\w.])dp\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def _documents():
  docs = [os.path.join(S.REPO_ROOT, "README.md")]
  for d, _, files in os.walk(S.DOCS):
    docs += [os.path.join(d, f) for f in files if f.endswith(".md")]
  return sorted(docs)


def _resolve(dotted):
  """getattr along `tf_dpiter.<dotted>`, importing a submodule where an attribute is one."""
  obj, path = tf_dpiter, "tf_dpiter"
  for part in dotted.split("."):
    path += "." + part
    if hasattr(obj, part):
      obj = getattr(obj, part)
    elif getattr(obj, "__file__", "").endswith("__init__.py"):
      obj = importlib.import_module(path)
    else:
      raise AttributeError(f"{path} does not exist")
  return obj


def _names(path):
  text = S.read(path)
  found = set()
  for m in _NAME.finditer(text):
    dotted = m.group(1)
    # `dp.keras.DPKeras*Optimizer` and friends stand for a family: check the prefix.
    if text[m.end():m.end() + 1] == "*":
      dotted = dotted.rsplit(".", 1)[0]
    found.add(dotted)
  return found


def test_the_documents_mention_dp_names():
  assert sum(len(_names(p)) for p in _documents()) > 50


@pytest.mark.parametrize("path", _documents(), ids=lambda p: os.path.relpath(p, S.REPO_ROOT))
def test_every_dp_name_resolves(path):
  bad = []
  for dotted in sorted(_names(path)):
    try:
      _resolve(dotted)
    except (AttributeError, ImportError) as e:
      bad.append(f"dp.{dotted}: {e}")
  assert not bad, f"{os.path.relpath(path, S.REPO_ROOT)} names what does not exist: {bad}"


@pytest.mark.parametrize("namespace", api_pages.NAMESPACES)
def test_every_public_name_is_on_its_api_page(namespace):
  module = importlib.import_module(f"tf_dpiter.{namespace}")
  text = S.read(os.path.join(S.DOCS, "api", f"{namespace}.md"))
  missing = [n for n in module.__all__ if not re.search(rf"[.`]{re.escape(n)}(`|\s|$)", text)]
  assert not missing, (f"docs/api/{namespace}.md lacks {missing}: run "
                       "`python -m tests.docs.api_pages`")


def test_every_api_page_of_a_namespace_is_in_the_nav():
  nav = S.read(os.path.join(S.REPO_ROOT, "mkdocs.yml"))
  for namespace in api_pages.NAMESPACES:
    assert f"api/{namespace}.md" in nav, namespace


def test_the_guides_are_python_3_syntax():
  for page in S.guide_pages():
    for line, code, _ in S.python_blocks(S.read(page)):
      ast.parse(code, f"{page}:{line}")
