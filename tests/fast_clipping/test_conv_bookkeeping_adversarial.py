"""Adversarial checks of a convolution's clipped sum where its norms need no per-example
gradient (rules/conv.py: the folded patch Gram, the unfolded patches, dilated kernels too
large to keep): one example whose input holds inf (an attacker's record, or a float16
overflow) gets a non-finite norm and clip factor 0, and must add exactly nothing. Were the
sum the tape's vector-Jacobian product of the layer's own convolution, its inf times the
zeroed output gradient would put NaN in every kernel entry of the released update: datasets
that differ in that one record would be told apart with certainty (the add/remove-one
relation, McMahan et al. 2018, "Learning differentially private recurrent language models",
Sec. 2). Each case: the sum with the poisoned record equals the sum with that record masked
out, with and without XLA; and one DP train step of the tutorial CNN keeps every weight
finite.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras import example_models
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping import registry

_L = keras.layers

# Nightly tier (-m slow): test_non_finite_input_adds_nothing runs each form once by default,
# graph and XLA alternating in sorted order (both modes stay: conv1d_causal, folded_gram and
# unfolded in graph, dilated and no_bias under XLA); the other mode of each form is nightly.
SLOW_CASES = {
    "test_non_finite_input_adds_nothing[conv1d_causal-True]",
    "test_non_finite_input_adds_nothing[dilated-False]",
    "test_non_finite_input_adds_nothing[folded_gram-True]",
    "test_non_finite_input_adds_nothing[no_bias-False]",
    "test_non_finite_input_adds_nothing[unfolded-True]"}
# (input shape, layer): the forms that form no per-example gradient once keeping one is
# refused (registry.MAX_PER_EXAMPLE_ENTRIES = 0), or by default (the 4x4/2 convolution of the
# tutorial CNN: the folded patch Gram)
_CASES = {
    "folded_gram": ((13, 13, 16), lambda: _L.Conv2D(32, 4, strides=2, activation="relu")),
    "unfolded": ((8, 8, 3), lambda: _L.Conv2D(4, 3, padding="same")),
    "dilated": ((9, 9, 2), lambda: _L.Conv2D(3, 3, dilation_rate=2)),
    "conv1d_causal": ((10, 3), lambda: _L.Conv1D(4, 3, padding="causal")),
    "no_bias": ((8, 8, 3), lambda: _L.Conv2D(4, 3, use_bias=False)),
}


def _loss(y, out):
  return tf.reduce_sum(tf.square(out - y), axis=-1)


def _sums(model, x, y, mask, jit):
  fn = tf.function(lambda x, y, m: clipping.clipped_grad_sum(
      model, x, y, _loss, 1.0, mask=m, physical_chunks=False), jit_compile=jit)
  grads, norms = fn(x, y, mask)
  return [tf.convert_to_tensor(g).numpy() for g in grads], norms.numpy()


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_non_finite_input_adds_nothing(case, jit, monkeypatch):
  if case != "folded_gram":
    monkeypatch.setattr(registry, "MAX_PER_EXAMPLE_ENTRIES", 0)
  shape, make = _CASES[case]
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input(shape), make(), _L.Flatten(), _L.Dense(2)])
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6,) + shape).astype("float32")
  y = rng.normal(size=(6, 2)).astype("float32")
  bad = x.copy()
  bad[2].flat[5] = np.inf
  ones = np.ones(6, np.float32)
  got, norms = _sums(model, bad, y, ones, jit)
  assert not np.isfinite(norms[2]) and np.all(np.isfinite(np.delete(norms, 2)))
  mask = ones.copy()
  mask[2] = 0.0
  want, _ = _sums(model, x, y, mask, jit)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g)), case
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_dp_train_step_of_the_tutorial_cnn_stays_finite(jit):
  """One DP-SGD step (noise on) of the tutorial CNN on 16 examples, one with an infinite
  pixel, with and without XLA: every weight after the step is finite."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential(example_models.mnist_cnn_layers())
  opt = dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                     learning_rate=0.1)
  model.compile(optimizer=opt,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=jit)
  opt.set_sampling(1000, 16 / 1000, "poisson", 16)
  rng = np.random.default_rng(0)
  x = rng.random((16, 28, 28, 1)).astype("float32")
  y = rng.integers(0, 10, 16).astype("int32")
  x[5, 14, 14, 0] = np.inf
  before = [v.numpy() for v in model.trainable_variables]
  model.train_on_batch(x, y)
  after = [v.numpy() for v in model.trainable_variables]
  assert all(np.all(np.isfinite(a)) for a in after)
  assert all(np.any(a != b) for a, b in zip(after, before))   # the step was taken
