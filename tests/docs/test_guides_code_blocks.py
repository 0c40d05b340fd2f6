"""Every Python code block of the documentation's guides runs as written.

The blocks of one page run in order in one namespace (a page is one tutorial), in a fresh
working directory. A block that cannot run here (it needs a running server or a deployment)
carries `<!-- no-run: reason -->` on the line before its fence; the reason is required.
"""

import contextlib
import io
import os

import pytest

from . import docs_support as S

PAGES = S.guide_pages()


def test_the_guides_exist():
  names = {os.path.relpath(p, S.DOCS) for p in PAGES}
  for page in ["getting-started.md", "guides/keras.md", "guides/accounting.md",
               "guides/correlated-noise.md", "guides/federated.md", "guides/draw-discard.md",
               "guides/auditing.md", "guides/tuning.md", "migration/tf-privacy.md",
               "migration/opacus.md", "design.md"]:
    assert page in names, page


# The pages whose blocks train for long (~90 s together) run with -m slow; by default the
# other pages run (getting-started.md among them: the same runner on a training page).
SLOW_PAGES = {"guides/keras.md", "migration/opacus.md", "guides/recipes.md",
              "guides/federated.md", "migration/tf-privacy.md", "guides/custom-queries.md"}


@pytest.mark.parametrize("page", [
    pytest.param(p, id=os.path.relpath(p, S.DOCS),
                 marks=pytest.mark.slow if os.path.relpath(p, S.DOCS) in SLOW_PAGES else ())
    for p in PAGES])
def test_code_blocks_of_a_page_run(page, tmp_path, monkeypatch):
  blocks = S.python_blocks(S.read(page))
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "__docs__"}
  ran = 0
  for line, code, no_run in blocks:
    if no_run is not None:
      assert len(no_run) > 10, f"{page}:{line}: a no-run marker needs its reason"
      compile(code, f"{page}:{line}", "exec")  # it must at least be valid Python
      continue
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(code, f"{page}:{line}", "exec"), namespace)  # pylint: disable=exec-used
    ran += 1
  assert ran or not blocks, f"{page}: every block is marked no-run"
