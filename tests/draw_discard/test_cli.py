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
  """`tf-dpiter-ddml --help` starts fast: no TensorFlow, aiohttp or redis import."""
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


def _spec_file(tmp_path):
  spec = tmp_path / "spec.json"
  spec.write_text(cli.known_weights_spec().to_json())
  return str(spec)


def _serve_config(tmp_path, monkeypatch, *flags):
  """Runs `serve` in-process up to http_server.run and returns what it would serve."""
  from tf_dpiter.draw_discard import http_server
  seen = {}

  def fake_run(svc, host, port, ssl_context=None, limits=None):
    seen.update(svc=svc, limits=limits)

  monkeypatch.setattr(http_server, "run", fake_run)
  assert cli.main(["serve", "--model", _spec_file(tmp_path), *flags]) == 0
  return seen["svc"], seen["limits"]


def test_serve_flags_reach_connection_draw_gate_and_sybil_settings(tmp_path, monkeypatch):
  """--max-per-prefix, --min-idle, --draw-min-updates and --new-identity-share are wired."""
  svc, limits = _serve_config(tmp_path, monkeypatch)  # defaults
  assert (limits.max_per_prefix, limits.min_idle_s) == (512, 1.0)
  assert svc.draw_gate.m == 4 and svc.admission.newcomers is None
  svc, limits = _serve_config(tmp_path, monkeypatch, "--max-per-prefix", "7", "--min-idle", "2.5",
                              "--draw-min-updates", "2", "--new-identity-share", "0.25")
  assert (limits.max_per_prefix, limits.min_idle_s) == (7, 2.5)
  assert svc.draw_gate.m == 2 and svc.admission.newcomers.share == 0.25
  settings = svc.meta["settings"]  # the join check sees them too
  assert settings["draw_min_updates"] == 2 and settings["new_identity_share"] == 0.25


@pytest.mark.parametrize("flag,value,name", [("--max-per-prefix", "0", "max_per_prefix"),
                                             ("--min-idle", "0", "min_idle_s"),
                                             ("--draw-min-updates", "0", "draw_min_updates"),
                                             ("--new-identity-share", "1.5",
                                              "new_identity_share")])
def test_serve_refuses_bad_new_settings_in_one_line(tmp_path, capsys, flag, value, name):
  assert cli.main(["serve", "--model", _spec_file(tmp_path), flag, value]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("tf-dpiter-ddml: error:")
  assert f"{name}=" in err[0] and value in err[0]


def test_serve_help_states_units_defaults_and_budget_memory(capsys):
  with pytest.raises(SystemExit):
    cli.main(["serve", "--help"])
  out = " ".join(capsys.readouterr().out.split())
  assert "16 p + 160 bytes per identity" in out and "8 p + 160" not in out
  for flag in ("--max-per-prefix", "--min-idle", "--draw-min-updates", "--new-identity-share"):
    assert flag in out


def test_open_file_limit_refusal_is_one_line_before_serving(tmp_path, monkeypatch, capsys):
  """http_server.ensure_open_files refuses a --max-connections above the hard limit: one line,
  exit 2, no traceback, and no "serving" line printed first."""
  import resource
  real = resource.getrlimit
  monkeypatch.setattr(resource, "getrlimit",
                      lambda r: (1024, 1024) if r == resource.RLIMIT_NOFILE else real(r))
  assert cli.main(["serve", "--model", _spec_file(tmp_path), "--max-connections", "5000",
                   "--port", "0"]) == 2
  cap = capsys.readouterr()
  assert "serving" not in cap.out and "Traceback" not in cap.err
  err = cap.err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("tf-dpiter-ddml: error:"), err
  assert "max_connections=5000" in err[0] and "--max-connections" in err[0]
