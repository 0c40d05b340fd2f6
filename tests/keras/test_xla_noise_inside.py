"""DP-SGD's noise drawn inside the XLA program (PrivateStep.compiled_noised_average).

Under jit_compile=True the default Gaussian query's own `get_noised_result` runs in the same
compiled program as the clipped sum (by default on accelerators; forced here on CPU), from
its generator, which is never saved; the ledger append of the events it returned stays
outside and exact. Checked here on the real fit step: the noise's
standard deviation (estimated from 12,000 coordinates of one update, against sigma / (q n)
computed by hand), independence of consecutive steps, the ledger identical to the
non-compiled path's, and the generator's state absent from the checkpoint.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

S, Z, N, B = 0.01, 10.0, 64, 16


def _model(jit, seed=None):
  model = dp.keras.DPSequential([keras.Input((300,)), keras.layers.Dense(40)])
  opt = dp.keras.DPKerasSGDOptimizer(S, Z, learning_rate=1.0, seed=seed)
  opt.private_step.set_flags(compiled_noise=True)   # the default on accelerators only
  model.compile(opt, keras.losses.MeanSquaredError(), jit_compile=jit)
  return model, opt


def _data():
  rng = np.random.default_rng(0)
  return rng.normal(size=(N, 300)).astype("float32"), rng.normal(size=(N, 40)).astype("float32")


def _updates(model, x, y, steps):
  out = []
  for _ in range(steps):
    before = model.layers[0].kernel.numpy().copy()
    model.fit(x, y, batch_size=B, epochs=1, steps_per_epoch=1, verbose=0)
    out.append((before - model.layers[0].kernel.numpy()).ravel())
  return out


@pytest.fixture(scope="module")
def compiled_run():
  """One compiled model's two single-step fits, shared by this module's tests: (model, opt,
  the two updates, the query generator's state between them)."""
  model, opt = _model(jit=True)
  x, y = _data()
  (u1,) = _updates(model, x, y, 1)
  generator = opt.private_step.base_query.noise_generator
  between = generator.state.numpy().copy()
  (u2,) = _updates(model, x, y, 1)
  return model, opt, (u1, u2), between


def test_the_compiled_draw_has_sigma_is_fresh_each_step_and_is_the_querys_own(tmp_path,
                                                                             compiled_run):
  """On one model: the noise of two compiled steps has the standard deviation sigma / (q n)
  and is drawn afresh each step; one Gaussian implementation: the compiled step calls the
  query's get_noised_result (its generator advances), and the generator's state is in no
  checkpoint."""
  model, opt, (u1, u2), before = compiled_run
  generator = opt.private_step.base_query.noise_generator
  assert model._dp_noise_inside   # pylint: disable=protected-access
  # update = (clipped sum + N(0, (Z S)^2)) / (q n) with q n = B (Poisson, lr 1): the clipped
  # sum has norm <= B S, the noise norm ~ Z S sqrt(12000), so the std is the noise's.
  expected = Z * S / B
  for u in (u1, u2):
    assert abs(np.std(u) / expected - 1.0) < 0.05, (np.std(u), expected)
  noise1, noise2 = u1 - u1.mean(), u2 - u2.mean()
  corr = float(noise1 @ noise2 / np.linalg.norm(noise1) / np.linalg.norm(noise2))
  assert abs(corr) < 0.05, corr    # independent draws: |corr| ~ 1/sqrt(12000) = 0.009
  assert int(opt.ledger.sample_count.numpy()) == int(opt.iterations.numpy()) == 2
  assert not np.array_equal(generator.state.numpy(), before)   # the query's generator drew
  path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ck"))
  reader = tf.train.load_checkpoint(path)
  state = generator.state.numpy()
  for name, _ in tf.train.list_variables(path):
    value = np.asarray(reader.get_tensor(name))
    assert not (value.shape == state.shape and np.array_equal(value, state)), name


def test_compiled_and_plain_steps_write_the_same_ledger(compiled_run):
  """The compiled run's ledger (two single-step fits) against a plain model's after the same
  two fits (the compiled one is the module's shared run: one XLA compilation per module)."""
  x, y = _data()
  ledgers = []
  for opt in (compiled_run[1], None):
    if opt is None:
      model, opt = _model(jit=False)
      _updates(model, x, y, 2)
    samples, queries = opt.ledger.get_arrays()[:2]
    ledgers.append((np.asarray(samples), np.asarray(queries)))
  assert len(ledgers[0][0]) == 2
  np.testing.assert_array_equal(ledgers[0][0], ledgers[1][0])
  np.testing.assert_array_equal(ledgers[0][1], ledgers[1][1])
