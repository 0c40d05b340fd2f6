"""The tutorial CNN (8x8/2 'same' and 4x4/2 'valid' convolutions: the first by chunked
depthwise per-example filter gradients under oneDNN, stride-block folded patches otherwise;
the second by the folded patch Gram and a book-keeping sum) clipped exactly under
both oneDNN settings: each runs in its own process, since TensorFlow reads
TF_ENABLE_ONEDNN_OPTS once per process. Tolerance: float32 round-off of sums of a few
thousand terms, 1e-5 of the largest reference entry."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.parametrize("onednn", [pytest.param("0", marks=pytest.mark.slow), "1"])
def test_tutorial_cnn_fast_sum_equals_per_example_loop(onednn):
  env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn,
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, os.path.join(HERE, "cnn_worker.py")],
                        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  out = json.loads(lines[-1][len("RESULT "):])
  assert out["onednn"] == (onednn == "1")
  for k in (1, 2):
    assert out[f"k{k}_sum_rel_err"] < 1e-5, out
    assert out[f"k{k}_norm_rel_err"] < 1e-5, out
