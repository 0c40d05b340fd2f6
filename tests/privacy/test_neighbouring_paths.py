"""The neighbouring-dataset suite extended to the training paths of issue 12.

Each case runs the real train step with noise 0 on neighbouring batches (add/remove one
example, adversarial additions from a fixed-seed search: `auditing.check_sensitivity`, or the
same construction through `fit` where train_on_batch does not apply) and asserts that the
largest change of the clipped sum never exceeds the sensitivity the ledger records:
  * a parameter-free batch-mixing layer: "auto" is routed to the vectorized path (exact),
    "fast" is refused with the layer's name;
  * jit_compile=True and max_physical_batch_size, on the fast and the vectorized paths;
  * MirroredStrategy on 2 logical CPU devices (subprocess), where train_on_batch is refused
    (Keras would hand every replica the whole batch: the sum counted twice);
  * the vectorized path under TF_ENABLE_ONEDNN_OPTS=1 with EinsumDense/MultiHeadAttention
    (in this process when it runs oneDNN, else a fresh process): routed to a per-example loop
    and equal to a hand-written one.
Dtype policies are in test_dtype_policies.py.
"""

import importlib.util
import itertools
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.auditing import sensitivity
from tf_dpiter.keras.optimizer import routing

# Nightly tier (-m slow, besides the marks below): the mixing layer under shuffled
# passes (Poisson stays: the same routing and exactness); the oneDNN case (below).
SLOW_CASES = {
    "test_parameter_free_mixing_layer_routed_and_exact[shuffle]",
    # the same worker function and `check_onednn` run in the oneDNN process of
    # test_custom_loop_onednn.py's default case (one oneDNN process for both files)
    "test_vectorized_path_under_onednn_matches_per_example_loop"}

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
RTOL = 1e-5


@keras.saving.register_keras_serializable(package="tf_dpiter_tests")
class BatchSoftmax(keras.layers.Layer):
  """Softmax over the batch axis: parameter-free, and every row depends on every other."""

  def call(self, inputs):
    return inputs * keras.ops.softmax(inputs, axis=0) * keras.ops.cast(
        keras.ops.shape(inputs)[0], inputs.dtype)


def _mixing_model(clipping):
  keras.utils.set_random_seed(0)
  inp = keras.Input((6,))
  h = BatchSoftmax(name="batch_softmax")(keras.layers.Dense(8, activation="tanh")(inp))
  model = dp.keras.DPModel(inp, keras.layers.Dense(3)(h))
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1,
                                                       clipping=clipping), loss=LOSS)
  return model


def _data(n=24, seed=1):
  rng = np.random.RandomState(seed)
  return rng.randn(n, 6).astype("float32") * 3, rng.randint(0, 3, n)


@pytest.mark.parametrize("policy", ["poisson", "shuffle"])
def test_parameter_free_mixing_layer_routed_and_exact(policy):
  model = _mixing_model("auto")
  x, y = _data()
  report = sensitivity.check_sensitivity(model, x, y, policy=policy, num_candidates=9)
  assert report.path == "vectorized"
  assert report.batch_mixing_layers == ("batch_softmax",)
  assert report.passed, str(report)
  assert report.measured_sensitivity > 0.5 * report.recorded_sensitivity


def test_parameter_free_mixing_layer_refused_on_fast_path():
  model = _mixing_model("fast")
  x, y = _data()
  with pytest.raises(ValueError, match=r"clipping='fast'.*\['batch_softmax'\]"):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def _mlp(clipping, jit, physical):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                                 keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1, clipping=clipping,
                                     max_physical_batch_size=physical)
  model.compile(optimizer=opt, loss=LOSS, jit_compile=jit)
  return model


# Every pair of clipping path, jit_compile and physical chunk in 4 runs; the rest of the
# product runs with -m slow.
_PATH_CASES = [("fast", True, 3), ("vectorized", False, 3), ("vectorized", True, None),
               ("fast", False, None)]


@pytest.mark.parametrize("clipping,jit,physical", [
    pytest.param(*c, marks=() if c in _PATH_CASES else pytest.mark.slow)
    for c in itertools.product(["fast", "vectorized"], [True, False], [3, None])])
def test_jit_and_physical_batches(clipping, jit, physical):
  model = _mlp(clipping, jit, physical)
  x, y = _data()
  report = sensitivity.check_sensitivity(model, x, y, num_candidates=6)
  assert report.path == clipping
  assert report.passed, str(report)
  assert report.measured_sensitivity > 0.5 * report.recorded_sensitivity



def test_the_default_path_runs_cover_every_pair():
  product = list(itertools.product(["fast", "vectorized"], [True, False], [3, None]))
  for i, j in itertools.combinations(range(3), 2):
    assert {(c[i], c[j]) for c in _PATH_CASES} == {(c[i], c[j]) for c in product}, (i, j)

def _worker(mode, **env):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
  proc = subprocess.run([sys.executable, os.path.join(HERE, "paths_worker.py"), mode],
                        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
def test_mirrored_strategy_two_replicas():
  out = _worker("mirrored")
  assert out["replicas"] == 2
  assert out["train_on_batch_refused"] is True
  for clipping in ("vectorized", "fast"):
    assert out[f"{clipping}_path"] == clipping
    recorded = out[f"{clipping}_recorded"]
    assert recorded == 1.0
    assert 0.5 * recorded < out[f"{clipping}_max_change"] <= recorded * (1 + RTOL), out


def _onednn_result(monkeypatch):
  """paths_worker's `onednn` result: in this process when it already runs oneDNN (TensorFlow
  reads TF_ENABLE_ONEDNN_OPTS once per process; the result, not the process, is tested), else
  in a fresh process with TF_ENABLE_ONEDNN_OPTS=1."""
  if not routing.onednn_enabled():
    return _worker("onednn", TF_ENABLE_ONEDNN_OPTS="1")
  monkeypatch.setattr(sys, "argv", [os.path.join(HERE, "paths_worker.py"), "onednn"])
  spec = importlib.util.spec_from_file_location("paths_worker_onednn",
                                                os.path.join(HERE, "paths_worker.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return json.loads(json.dumps(module.onednn()))   # the worker's JSON types, as printed


def check_onednn(out):
  """Checks paths_worker.onednn()'s result `out` (here and in test_custom_loop_onednn's
  default case, whose oneDNN process computes it)."""
  assert out["onednn"] is True
  assert {"mha", "einsum"} <= set(out["affected"])
  assert out["use_vectorized_map"] is False
  assert out["sum_norm"] > 0.05
  assert out["max_abs_diff"] < 1e-6 * max(1.0, out["sum_norm"]), out
  assert out["check_path"] == "vectorized"
  assert out["check_passed"] is True and out["check_ratio"] <= 1 + RTOL, out


def test_vectorized_path_under_onednn_matches_per_example_loop(monkeypatch):
  """Under oneDNN tf.vectorized_map gets these layers' per-example gradients wrong or crashes;
  the guard routes them to a per-record loop, equal to the hand-written loop."""
  check_onednn(_onednn_result(monkeypatch))
