"""Noise never repeats within one execution of several steps (steps_per_execution=3 under
XLA, the noise drawn inside the compiled program and after it): with a seeded generator (tests
only) the weights after 6 steps equal those of 6 executions of one step, whose consecutive
updates (mostly noise) are uncorrelated: each step of an execution drew its own words (the
shared refinement and the word draw read and advance the generator's Philox state inside
Keras's loop over steps)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data import python_source

_N, _E, _STEPS = 100, 8, 6


def _batches():
  rng = np.random.RandomState(0)
  out = []
  for real in (7, 9, 8, 6, 10, 8):
    x = np.zeros((16, 30), "float32")
    y = np.zeros((16, 20), "float32")
    w = np.zeros(16, "float32")
    x[:real], y[:real], w[:real] = rng.randn(real, 30), rng.randn(real, 20), 1.0
    out.append((x, y, w))
  return out


def _trained(spe, compiled_noise, z, steps=_STEPS):
  """(model, its kernels: initial, then after each execution) after `steps` steps."""
  keras.utils.set_random_seed(1)
  model = dp.keras.DPSequential([keras.Input((30,)), keras.layers.Dense(20)])
  opt = dp.keras.DPKerasSGDOptimizer(0.1, z, learning_rate=1.0, seed=1234)
  opt.private_step.set_flags(compiled_noise=compiled_noise)
  model.compile(opt, keras.losses.MeanSquaredError(), jit_compile=True, steps_per_execution=spe)
  opt.set_sampling(_N, _E / _N, "poisson", _E)
  spec = (tf.TensorSpec((None, 30), tf.float32), tf.TensorSpec((None, 20), tf.float32),
          tf.TensorSpec([None], tf.float32))
  batches = _batches()[:steps]
  kernels = [model.layers[0].kernel.numpy().copy()]
  if spe == 1:   # one execution per step: the kernel after each
    for b in batches:
      ds = python_source.python_dataset(lambda b=b: iter([b]), spec)
      model.fit(ds, steps_per_epoch=1, epochs=1, verbose=0)
      kernels.append(model.layers[0].kernel.numpy().copy())
  else:
    ds = python_source.python_dataset(lambda: iter(batches), spec)
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)
    kernels.append(model.layers[0].kernel.numpy().copy())
  assert int(opt.iterations.numpy()) == steps
  assert int(opt.ledger.sample_count.numpy()) == steps
  return model, kernels


@pytest.mark.parametrize("compiled_noise", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_three_steps_per_execution_draw_what_three_executions_draw(compiled_noise):
  _, k3 = _trained(3, compiled_noise, 1.0)
  _, k1 = _trained(1, compiled_noise, 1.0)
  np.testing.assert_allclose(k3[-1], k1[-1], rtol=1e-4, atol=1e-5)
  # the noise is most of each update (std 0.1 / 8 per entry): consecutive updates of the
  # one-step run uncorrelated, so a repeated draw in the 3-step run would not match
  updates = [(b - a).ravel() for a, b in zip(k1, k1[1:])]
  for u, v in zip(updates, updates[1:]):
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.3
