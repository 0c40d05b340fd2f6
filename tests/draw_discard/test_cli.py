"""tf-dpiter-ddml command line (privacy statement, example specs) and argument validation."""

import json

import pytest

from tf_dpiter.draw_discard import cli, glm


def test_privacy_command_prints_three_adversaries(capsys):
  assert cli.main(["privacy", "--epsilon", "log(32)", "--k", "20", "--T", "1000"]) == 0
  out = capsys.readouterr().out
  assert "adversary I " in out and "adversary II " in out and "adversary III" in out
  assert "1.646" in out  # 19/40 * ln 32


@pytest.mark.parametrize("kind,n", [("known-weights", 33), ("dense", 387)])
def test_example_spec_roundtrips(capsys, kind, n):
  cli.main(["example-spec", "--kind", kind, "--num-weights", str(n)])
  spec = glm.ModelSpec.from_json(capsys.readouterr().out)
  assert spec.num_weights == n


def test_serve_requires_model():
  with pytest.raises(SystemExit):
    cli.main(["serve"])


def test_spec_rejects_unknown_key():
  d = json.loads(cli.known_weights_spec().to_json())
  d["colour"] = "red"
  with pytest.raises(ValueError, match="unknown keys"):
    glm.ModelSpec.from_dict(d)


def test_help_imports_no_tensorflow_or_server_stack():
  """`tf-dpiter-ddml --help` starts fast: no TensorFlow, aiohttp or redis import (issue 14)."""
  import subprocess
  import sys
  code = ("import sys\nfrom tf_dpiter.draw_discard import cli\ntry:\n  cli.main(['--help'])\n"
          "except SystemExit:\n  pass\nprint(sorted(m for m in ('tensorflow', 'aiohttp', 'redis')"
          " if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "[]"


def test_adopt_store_needs_a_state_file(tmp_path, capsys):
  spec = tmp_path / "spec.json"
  spec.write_text(cli.known_weights_spec().to_json())
  assert cli.main(["serve", "--model", str(spec), "--adopt-store"]) == 2
  assert "--adopt-store" in capsys.readouterr().err
