"""The README keeps its two commands (`.ci/run` extracts the test command between the markers),
its quickstart runs as written, and every file it links to exists."""

import os
import re

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = ('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && '
        'python tutorials/mnist_dpsgd_keras.py --quick --data_path ../shared/data/mnist.npz')
TEST = ('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && '
        'python -m pytest -q -n 2')


def _readme():
  with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
    return f.read()


def _block_after(text, marker):
  assert text.count(marker) == 1, f"{marker} must appear exactly once"
  return re.search(r"```[^\n]*\n(.*?)```", text[text.index(marker):], re.S).group(1).strip()


def test_the_two_commands_are_between_their_markers():
  text = _readme()
  assert _block_after(text, "<!-- main-command -->") == MAIN
  assert _block_after(text, "<!-- test-command -->") == TEST
  # The first screen: both commands within the first 40 lines.
  head = "\n".join(text.split("\n")[:45])
  assert "<!-- main-command -->" in head and "<!-- test-command -->" in head


def test_readme_says_how_to_obtain_mnist_npz():
  text = " ".join(_readme().split())
  assert 'keras.datasets.mnist.load_data()"` downloads it and caches it at `~/.keras/datasets/mnist.npz`' in text
  assert "copy that file to `../shared/data/mnist.npz`" in text and "`--data_path`" in text


def test_readme_is_an_entry_point_of_about_150_lines():
  assert len(_readme().split("\n")) <= 170


def test_readme_quickstart_runs(tmp_path, monkeypatch, capsys):
  text = _readme()
  section = text[text.index("## Quickstart"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  monkeypatch.chdir(tmp_path)
  exec(compile(code, "README.md", "exec"), {})  # pylint: disable=exec-used
  out = capsys.readouterr().out
  assert "-DP over 60 samples" in out
  assert "add or remove one example" in out and "Poisson sampling (q=0.05, n=1000)" in out


def test_every_relative_link_of_the_readme_exists():
  links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", _readme())
  local = [l for l in links if not re.match(r"[a-z]+://", l)]
  assert local, "the README links into the docs"
  missing = [l for l in local if not os.path.exists(os.path.join(REPO_ROOT, l))]
  assert not missing, f"README links to missing files: {missing}"
