"""The tutorial CNN (8x8/2 'same' and 4x4/2 'valid' convolutions: the first by chunked
depthwise per-example filter gradients under oneDNN, stride-block folded patches otherwise;
the second by the folded patch Gram and a book-keeping sum) clipped exactly under
both oneDNN settings. TensorFlow reads TF_ENABLE_ONEDNN_OPTS once per process: the setting
this process runs with is checked in it, the other in a subprocess that sets it. Norms: the
second convolution's are upper bounds (the exact norm plus gamma_L sum_t ||a_t|| ||b_t||, the
float32 rounding of the record's terms): never below the reference's, at most 1e-3 above. Sums:
1e-3 of the largest reference entry (the clip factors move with the norms)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tf_dpiter.keras.optimizer import routing

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _worker_lines(onednn, capsys):
  """cnn_worker's output lines under TF_ENABLE_ONEDNN_OPTS=`onednn`: its main() in this
  process when this process already runs with that oneDNN setting (the worker's output, not
  its process, is what is tested), else in a subprocess that sets it."""
  if routing.onednn_enabled() == (onednn == "1"):
    spec = importlib.util.spec_from_file_location("cnn_worker", os.path.join(HERE,
                                                                             "cnn_worker.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    module.main()
    return capsys.readouterr().out.splitlines()
  env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn,
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, os.path.join(HERE, "cnn_worker.py")],
                        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.splitlines()


@pytest.mark.parametrize("onednn", [pytest.param("0", marks=pytest.mark.slow), "1"])
def test_tutorial_cnn_fast_sum_equals_per_example_loop(onednn, capsys):
  lines = [l for l in _worker_lines(onednn, capsys) if l.startswith("RESULT ")]
  assert lines, "cnn_worker printed no RESULT line"
  out = json.loads(lines[-1][len("RESULT "):])
  assert out["onednn"] == (onednn == "1")
  for k in (1, 2):
    assert out[f"k{k}_sum_rel_err"] < 1e-3, out
    assert -1e-6 <= out[f"k{k}_norm_rel_low"] <= out[f"k{k}_norm_rel_high"] <= 1e-3, out
