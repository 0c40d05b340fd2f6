"""Custom loops on oneDNN: every form of compute_private_gradients, with or without model=.

Relation: add/remove one example (Poisson sampling); the ledger records sensitivity C. On a
MultiHeadAttention + 3-D EinsumDense model (the layers whose vectorized per-example gradients
oneDNN breaks), with TF_ENABLE_ONEDNN_OPTS=1 in a subprocess (so a native crash fails the test
instead of killing it), each form (data, vector loss, tape; each with and without model=) runs
the real private step with noise 0 and normalize=False, so its output is the pre-noise clipped
sum. One example removed (mask 0) or added (adversarial, up to 1e3 x the data's scale) moves
that sum by <= the recorded sensitivity, and the sum matches a per-example loop computed
eagerly one example at a time (float64), or the call is refused with a ValueError.
Before: the data form without model= vectorized and aborted with `dnnl::error`.
"""

import json
import os
import subprocess
import sys

import pytest

from tf_dpiter.keras.optimizer import custom_loops
from tf_dpiter.keras.optimizer import routing

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FORMS = ("data", "data_model", "vector", "vector_model", "tape", "tape_model")


def _worker(*forms):
  env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(HERE, "onednn_loop_worker.py"), *forms],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
                       check=False)
  assert out.returncode == 0, out.stderr[-3000:]   # never a crash
  return json.loads([l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])


def test_every_custom_loop_form_under_onednn_stays_within_sensitivity():
  out = _worker(*FORMS)
  if not out["onednn"]:
    pytest.skip("this TensorFlow build has no oneDNN (TF_ENABLE_ONEDNN_OPTS=1 has no effect)")
  for form in FORMS:
    got = out[form]
    if "refused" in got:
      assert "model=" in got["refused"], (form, got)
      continue
    assert got["move_over_sensitivity"] <= 1 + 1e-5, (form, got)
    assert got["move_over_sensitivity"] > 0.5, (form, got)      # the clip is reached
    assert got["max_deviation_from_reference"] <= 1e-6 * got["recorded"] * 6, (form, got)


def test_without_model_vectorizes_only_off_onednn():
  assert custom_loops.vectorize_records(None) == (not routing.onednn_enabled())
