"""The LoRA rules' clipped sum from the clip factors (rules/lora.py, registry.FactorSums).

When a LoRA layer's per-example gradients are not kept (large adapters: BERT-base's query and
value projections have 73,728-entry A's), its clipped sum of A, B (and W0, the bias, when
trained) is formed from the clip factors by rank-r contractions, not by a vector-Jacobian
product through the merged kernel (a tape gradient per layer traced a backward pass through
the network below it: 55,421 ops for BERT-base with LoRA r = 8, 9,375 without). Here the
keep thresholds are set to 0 so that the small test layers take that form, and each sum is
compared with the per-record loop of conftest.py (each record's gradient from its own tape,
clipped in float64), with and without XLA; a record whose input is not finite adds nothing.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping import registry
from tests.fast_clipping import test_lora_rules as lora_cases

_CASES = [c for c in lora_cases.CASES if not c[0].startswith("embedding")]

# Every case in graph mode by default; under XLA by default the two broadest (the Dense with
# W0 and the bias trained, the EinsumDense merging heads), the other five with -m slow
# (tests/conftest.py marks these ids slow; benchmarks/SUITE_CUTS.md).
SLOW_CASES = {f"test_lora_factor_sums_exact[{name}-True]" for name in
              ("dense", "dense_seq", "dense_seq_alpha_nobias", "einsum", "einsum_heads")}
# graph mode stays on the other five cases; these two layers stay by default under XLA
SLOW_CASES |= {"test_lora_factor_sums_exact[dense_seq_base_trainable-False]",
               "test_lora_factor_sums_exact[einsum_merge_heads-False]"}


@pytest.fixture(name="no_kept_grads")
def _no_kept_grads(monkeypatch):
  monkeypatch.setattr(registry, "MAX_PER_EXAMPLE_ENTRIES", 0)
  monkeypatch.setattr(registry, "MAX_DIRECT_PER_EXAMPLE_ENTRIES", 0)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_lora_factor_sums_exact(case, jit, no_kept_grads, clip_reference, monkeypatch):  # pylint: disable=unused-argument
  _, in_shape, make, kw = case
  model, layer = lora_cases.lora_model(in_shape, make, "float32", **kw)
  x, y = lora_cases._data(in_shape, "float32")  # pylint: disable=protected-access
  memo = {}   # each record's loop gradient once for both calls
  _, ref_norms = clip_reference(model, x, y, lora_cases.mse, 1.0, 1, None, memo=memo)
  clip = float(np.median(ref_norms))
  ref_grads, ref_norms = clip_reference(model, x, y, lora_cases.mse, clip, 1, None, memo=memo)
  made = []
  orig_new = registry.FactorSums.__new__
  monkeypatch.setattr(registry.FactorSums, "__new__",
                      lambda cls, *a, **k: made.append(1) or orig_new(cls, *a, **k))
  fn = tf.function(lambda x, y: clipping.clipped_grad_sum(model, x, y, lora_cases.mse, clip),
                   jit_compile=jit)
  grads, norms = fn(x, y)
  assert made, "the LoRA layer's sum was not formed from the clip factors"
  np.testing.assert_allclose(norms.numpy(), ref_norms, rtol=1e-4, atol=1e-6)
  for g, r, v in zip(grads, ref_grads, model.trainable_variables):
    scale = max(1.0, float(np.max(np.abs(r))))
    np.testing.assert_allclose(g.numpy(), r, atol=1e-4 * scale, rtol=1e-4, err_msg=v.path)
  assert {id(v) for v in layer.trainable_variables} <= {id(v) for v in model.trainable_variables}


@pytest.mark.parametrize("case", [_CASES[1], _CASES[5]], ids=lambda c: c[0])
def test_lora_non_finite_record_adds_nothing(case, no_kept_grads):  # pylint: disable=unused-argument
  _, in_shape, make, kw = case
  model, _ = lora_cases.lora_model(in_shape, make, "float32", **kw)
  x, y = lora_cases._data(in_shape, "float32", seed=3)  # pylint: disable=protected-access
  bad = x.numpy().copy()
  bad[2].flat[1] = np.inf
  got, norms = clipping.clipped_grad_sum(model, bad, y, lora_cases.mse, 0.5)
  assert not np.isfinite(norms.numpy()[2])
  keep = np.array([0, 1, 3, 4, 5])
  want, _ = clipping.clipped_grad_sum(model, tf.gather(x, keep), tf.gather(y, keep),
                                      lora_cases.mse, 0.5)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g.numpy()))
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=2e-4, atol=2e-5)


def test_lora_graph_grows_by_a_layer_not_by_a_backward_pass(no_kept_grads):  # pylint: disable=unused-argument
  """Ops of the traced clipped sum for 2 and 8 stacked LoRA EinsumDense layers: the 6 extra
  layers add a bounded number of ops each (a tape gradient per layer grows with the depth)."""
  counts = []
  for depth in (2, 8):
    keras.utils.set_random_seed(0)
    inp = keras.Input((4, 6))
    h, layers = inp, []
    for _ in range(depth):
      layer = keras.layers.EinsumDense("abc,cd->abd", (4, 6), bias_axes="d")
      layers.append(layer)
      h = layer(h)
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    for layer in layers:
      lora_cases.enable_lora(layer)
    x = np.zeros((4, 4, 6), np.float32)
    y = np.zeros((4, 3), np.float32)
    graph = tf.function(lambda m=model: clipping.clipped_grad_sum(
        m, x, y, lora_cases.mse, 1.0)[0]).get_concrete_function().graph
    counts.append(len(graph.get_operations()))
  assert (counts[1] - counts[0]) / 6 < 200, counts
