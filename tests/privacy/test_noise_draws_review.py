"""Review: the DP step draws its Gaussian noise exactly once per logical batch on every path,
and a restore never makes it draw a noise again.

McMahan et al., "A General Approach to Adding Differential Privacy to Iterative Training
Procedures" (2018), Section 7: one noise draw per sample, one ledger sample per draw. Counted
on the noise generator itself (`private_step.noise_generator`, a Philox tf.random.Generator):
each draw op advances its counter by a fixed amount for a given size, so a step's advance
equals that of ONE direct draw of the model's parameter count
(`randomness.padded_normal_halves`, the query's draw) only if the step drew once. Paths:
train_on_batch (vectorized and fast, graph and XLA, the noise inside the compiled program or
after it), records of k examples, physical chunks, fit with several steps per execution.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data import python_source
from tf_dpiter.dp_query import randomness

_B = 16
_SIZE = 6 * 4 + 4 + 4 * 3 + 3   # the model's parameters


def _model(clipping="auto", jit=False, micro=None, policy="poisson", phys=None,
           compiled=None, spe=1):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
                                 keras.layers.Dense(3)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, micro, learning_rate=0.1, clipping=clipping,
                                     max_physical_batch_size=phys)
  if compiled is not None:
    opt.private_step.set_flags(compiled_noise=compiled)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True), jit_compile=jit, steps_per_execution=spe)
  opt.set_sampling(1000, _B / 1000, policy, _B)
  return model


def _counter(generator):
  return int(generator.state.numpy()[0])


def _one_draw():
  """The counter advance of one draw of _SIZE values on a fresh generator."""
  generator = tf.random.Generator.from_seed(1)
  before = _counter(generator)
  randomness.padded_normal_halves(generator, _SIZE, 1.0)
  return _counter(generator) - before


def _batch():
  rng = np.random.RandomState(0)
  x = rng.randn(_B, 6).astype("float32")
  y = rng.randint(0, 3, _B).astype("int64")
  w = np.ones(_B, np.float32)
  w[12:] = 0.0   # padding rows
  return x, y, w


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("kw", [
    dict(micro=8, policy="fixed_size"),
    pytest.param(dict(clipping="fast"), marks=_SLOW),
    pytest.param(dict(jit=True, compiled=True), marks=_SLOW),
    pytest.param(dict(), marks=_SLOW),
    pytest.param(dict(jit=True), marks=_SLOW),
    pytest.param(dict(jit=True, compiled=True, clipping="fast"), marks=_SLOW),
    pytest.param(dict(phys=8), marks=_SLOW),
    pytest.param(dict(phys=8, jit=True, compiled=True), marks=_SLOW),
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_each_train_on_batch_draws_once(kw):
  model = _model(**kw)
  x, y, w = _batch()
  model.train_on_batch(x, y, sample_weight=w)   # traced and built
  generator = model.optimizer.private_step.noise_generator
  advances = []
  for _ in range(3):
    before = _counter(generator)
    model.train_on_batch(x, y, sample_weight=w)
    advances.append(_counter(generator) - before)
  assert advances == [_one_draw()] * 3
  opt = model.optimizer
  assert int(opt.ledger.sample_count.numpy()) == int(opt.iterations.numpy()) == 4


@pytest.mark.parametrize("kw", [
    dict(spe=3, jit=True, compiled=True, phys=8),
    pytest.param(dict(), marks=_SLOW),
    pytest.param(dict(clipping="fast", phys=8), marks=_SLOW),
])
def test_fit_draws_once_per_step(kw):
  model = _model(**kw)
  x, y, w = _batch()
  spec = (tf.TensorSpec((None, 6), tf.float32), tf.TensorSpec([None], tf.int64),
          tf.TensorSpec([None], tf.float32))
  ds = python_source.python_dataset(lambda: iter([(x, y, w)] * 6), spec)
  model.fit(ds, steps_per_epoch=3, epochs=1, verbose=0)
  generator = model.optimizer.private_step.noise_generator
  before = _counter(generator)
  model.fit(ds, steps_per_epoch=3, epochs=1, verbose=0)
  assert _counter(generator) - before == 3 * _one_draw()
  opt = model.optimizer
  assert int(opt.ledger.sample_count.numpy()) == int(opt.iterations.numpy()) == 6


@pytest.mark.slow
def test_a_restored_step_draws_a_new_noise(tmp_path):
  """load_weights back to the weights before a step, then the same step again: the
  generator goes on (never restored), so the second update is another noise."""
  model = _model()
  x, y, w = _batch()
  model.train_on_batch(x, y, sample_weight=w)
  path = str(tmp_path / "m.weights.h5")
  model.save_weights(path)
  w0 = [a.copy() for a in model.get_weights()]
  generator = model.optimizer.private_step.noise_generator
  first_counter = _counter(generator)
  model.train_on_batch(x, y, sample_weight=w)
  first = [a - b for a, b in zip(model.get_weights(), w0)]
  model.load_weights(path)
  assert _counter(generator) == first_counter + _one_draw()   # not rewound by the restore
  np.testing.assert_array_equal(model.get_weights()[0], w0[0])
  model.train_on_batch(x, y, sample_weight=w)
  second = [a - b for a, b in zip(model.get_weights(), w0)]
  assert _counter(generator) == first_counter + 2 * _one_draw()
  # noise of stddev 1 / 16 per coordinate: two draws differ in every coordinate
  assert all(np.all(a != b) for a, b in zip(first, second))
