"""Custom loops on oneDNN: every form of the private step, with or without model=.

Relation: add/remove one example (Poisson sampling); the ledger records sensitivity C. Under
oneDNN (in the test's process when it already runs oneDNN, else in a subprocess with
TF_ENABLE_ONEDNN_OPTS=1; under pytest-xdist a native crash fails the test as a crashed
worker), onednn_loop_worker runs each custom-loop form (data, vector loss, tape, and TF Privacy's
minimize spellings, each with and without model=) with noise 0 and normalize=False, so its
output is the pre-noise clipped sum, on three adversarial models: MultiHeadAttention + 3-D
EinsumDense (the layers whose vectorized per-example gradients oneDNN breaks), a
BatchNormalization in training mode and a weightless batch-centering layer (both mix the
examples of a batch). One example removed (mask 0) or added (adversarial, up to 1e3 x the
data's scale) moves that sum by <= the recorded sensitivity, and the sum matches a
per-example loop computed eagerly one example at a time (float64), or the call is refused
with a ValueError that says what to do. Which calls are refused is fixed, not left open:
the data form runs unless the model writes state from the data (the BatchNormalization's
moving statistics, released unclipped and un-noised: refused in every form that reaches the
step); the whole-batch forms run only with model= on a model with no mixing layer. Before: the data form without model= vectorized and aborted with
`dnnl::error`; the whole-batch forms without model= were accepted on a mixing model
(test_custom_loop_batch_mixing measures what they released).
The default case's oneDNN process also runs test_neighbouring_paths' oneDNN check
(paths_worker.onednn, checked by its `check_onednn`): one oneDNN process for both files.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.privacy import test_neighbouring_paths
from tf_dpiter.keras.optimizer import custom_loops
from tf_dpiter.keras.optimizer import routing

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BASE_FORMS = ("data", "vector", "tape", "minimize", "minimize_tape")
FORMS = tuple(f + s for f in BASE_FORMS for s in ("", "_model"))


def _results(cases):
  """onednn_loop_worker's results for `cases`: computed in this process when it already runs
  oneDNN (TensorFlow reads TF_ENABLE_ONEDNN_OPTS once per process; the results, not the
  process, are tested), else by the worker script in a fresh process with oneDNN on."""
  if not routing.onednn_enabled():
    return _worker(cases)
  spec = importlib.util.spec_from_file_location("onednn_loop_worker_here",
                                                os.path.join(HERE, "onednn_loop_worker.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return json.loads(json.dumps(module.results(cases)))   # the worker's JSON types, as printed


def _worker(cases):
  env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(HERE, "onednn_loop_worker.py"), *cases],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
                       check=False)
  assert out.returncode == 0, out.stderr[-3000:]   # never a crash
  return json.loads([l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])


def _expected_refusal(kind, form):
  """(the message fragments of the refusal this case must get, whether it names the call),
  or None (it must run)."""
  if kind == "bn" and (form.startswith("data") or form.endswith("_model")):
    # the moving statistics written from the data in training mode: the state-writes check
    # refuses them whatever the form (they would be released unclipped and un-noised)
    return ("written from the data", "bn/moving_mean", "bn/moving_variance"), False
  if form.startswith("data"):
    return None                       # each record run alone: exact for every model
  if not form.endswith("_model"):
    return ("model=None", "pass model=", "data="), True
  return {"einsum": None, "centering": (("['centering']", "data="), True)}[kind]


def _check(out, kind, form):
  got, expected = out[f"{kind}:{form}"], _expected_refusal(kind, form)
  if expected is not None:
    refusal, names_call = expected
    assert "refused" in got, (kind, form, got)
    message = got["refused"].lower()
    assert all(part.lower() in message for part in refusal), (kind, form, got)
    if names_call:
      assert ("tape=tape" in message) == ("tape" in form), (kind, form, got)
    return
  assert "refused" not in got, (kind, form, got)
  assert got["move_over_sensitivity"] <= 1 + 1e-5, (kind, form, got)
  assert got["move_over_sensitivity"] > 0.5, (kind, form, got)     # the clip is reached
  # 6 float32 roundings, plus the clip shrink 1 / (1 + eta) of the loop's public row bound
  # (eta ~1e-5 at this batch), relative to the sum of `records` records of norm <= C, whose
  # coordinates reach records * C (the centering model's: 3.8e-6 = 1.3e-5 x 6 C)
  bound = (6e-6 + 5e-5) * got["recorded"] * got["records"]
  assert got["max_deviation_from_reference"] <= bound, (kind, form, got)


@pytest.mark.parametrize("kinds", [("einsum",), pytest.param(("bn", "centering"), marks=pytest.mark.slow)])
def test_every_custom_loop_form_under_onednn_stays_within_sensitivity_or_is_refused(kinds):
  # the einsum case also runs test_neighbouring_paths' oneDNN check (paths_worker.onednn) in
  # its oneDNN process: one process for both files in the default suite
  paths = ["paths:onednn"] if "einsum" in kinds else []
  out = _results([f"{kind}:{form}" for kind in kinds for form in FORMS] + paths)
  if paths:   # first: that check requires oneDNN rather than skipping without it
    test_neighbouring_paths.check_onednn(out["paths:onednn"])
  if not out["onednn"]:
    pytest.skip("this TensorFlow build has no oneDNN (TF_ENABLE_ONEDNN_OPTS=1 has no effect)")
  for kind in kinds:
    for form in FORMS:
      _check(out, kind, form)


def test_without_model_vectorizes_only_off_onednn():
  assert custom_loops.vectorize_records(None) == (not routing.onednn_enabled())
