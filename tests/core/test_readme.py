"""The README's privacy-core example runs as written (keeps the README true)."""

import os
import re

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_readme_privacy_core_example_runs(tmp_path, monkeypatch, capsys):
  text = open(os.path.join(REPO_ROOT, "README.md")).read()
  section = text[text.index("## Privacy core"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  monkeypatch.chdir(tmp_path)
  exec(compile(code, "README.md", "exec"), {})  # pylint: disable=exec-used
  out = capsys.readouterr().out
  assert "-DP over 100 samples" in out and "Poisson sampling" in out
  assert os.path.exists(tmp_path / "ledger.json")
