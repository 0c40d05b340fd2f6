"""Review R17 (session 46): noise never reused, steps never uncharged, on the combinations the
rollback tests (test_rollback_noise, test_noise_replay_review, test_rollback_paths_review,
tests/correlated/test_keras_noise_resume) do not cover. Noise on.

Measure: a Dense(300 -> 40) on all-zero records and targets has a kernel gradient of exactly 0
for every record, so a kernel update is -lr times the released noise over the denominator:
12,000 coordinates of it. Two updates with the same noise have correlation 1, independent ones
|corr| < 5 / sqrt(12,000) (5 standard errors). The ledger must charge every released update.

Relation: add/remove one example (Poisson, q = B / n); cyclic Poisson for BLT; replace-one
(shuffled passes) for the tree. Unit: the example.

Measured at 2fa29e8 (load about 5 on 2 cores, 2026-12-02):
- negative (fresh and charged): two unseeded optimizers with the noise drawn inside the XLA
  program (corr -0.008); an optimizer rebuilt by `from_config(get_config())` continuing the
  same weights (corr 0.006); a rollback (kernel and `iterations.assign`) of a fit with
  steps_per_execution=3 under jit_compile=True and the compiled draw, the three steps again
  (corr 0.015, ledger 9 of 9 released after a first fit); a custom loop's step retried after
  an exception between compute_private_gradients and apply_private_gradients, eagerly (corr
  0.002, ledger 2 for 2 noised results, the dropped result and a second apply of the used one
  refused) and traced (an assertion failing between them: ledger 1, weights unmoved; the
  retry charged);
  BLT and the tree under jit_compile=True with steps_per_execution=2, rolled back by
  `iterations.assign` or `load_weights`: the next fit refused (BLT eagerly by the cyclic
  sampler, the tree by the step's assertion), nothing released or charged.

Finding (fixed: weight_fingerprints' `_RELEASED`): a DP model's trained weights copied BY VALUE
into a new DP model (`set_weights(dp_model.get_weights())`, or `keras.models.clone_model` +
`set_weights` + `make_private`) in the same process start a new ledger holding none of the
steps the weights took. S = 1, z = 1, n = 64, B = 16 (Poisson q = 0.25): 4 steps, then the
copy's 1: the copy's ledger 1 sample and epsilon(delta = 1e-5, the default accountant) = 3.08,
the original's 4 steps 4.87; the 5 released steps are 5.27 by dp-accounting's RDP by hand. The
file paths carry the ledger (load_weights of a file with a ledger, load_model(compile=False):
tests/privacy/test_ledger_carried.py) and shared variables carry their charges
(`optimizers.adopt_recorded_ledgers`); a copy of the values carried nothing. Now the digest of
every state a run's private updates produced keeps a weak reference to that run's ledger, and a
variable a DP run starts from that holds such values adopts it (each run once): 5 of 5, epsilon
5.27 as by hand.
"""

import math
import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

S, Z, N, B = 0.5, 3.0, 1000, 16
LIMIT = 5 / math.sqrt(12_000)


def _corr(a, b):
  a = np.ravel(a) - np.mean(a)
  b = np.ravel(b) - np.mean(b)
  return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _model(jit=False, compiled=None, spe=1, opt=None):
  model = dp.keras.DPSequential([keras.Input((300,)), keras.layers.Dense(40)])
  opt = opt or dp.keras.DPKerasSGDOptimizer(S, Z, learning_rate=1.0)
  if compiled is not None:
    opt.private_step.set_flags(compiled_noise=compiled)
  model.compile(opt, keras.losses.MeanSquaredError(), jit_compile=jit, steps_per_execution=spe)
  opt.set_sampling(N, B / N, "poisson")
  return model, opt


def _zeros(rows=B):
  return np.zeros([rows, 300], "float32"), np.zeros([rows, 40], "float32")


def _step(model):
  kernel = model.layers[0].kernel
  before = kernel.numpy().copy()
  model.train_on_batch(*_zeros())
  return kernel.numpy() - before


def test_an_optimizer_from_its_config_draws_other_noise():
  """from_config(get_config()) of a trained optimizer (its ledger travels in the config) on a
  copy of the weights: the two next updates are independent."""
  model, opt = _model()
  _step(model)
  other, _ = _model(opt=type(opt).from_config(opt.get_config()))
  other.set_weights(model.get_weights())
  assert abs(_corr(_step(model), _step(other))) < LIMIT


@pytest.mark.slow
def test_two_optimizers_with_the_compiled_draw_are_independent():
  """Unseeded, the noise drawn inside the XLA program: each query's own generator."""
  first, _ = _model(jit=True, compiled=True)
  second, _ = _model(jit=True, compiled=True)
  assert abs(_corr(_step(first), _step(second))) < LIMIT


def test_a_rolled_back_execution_of_several_steps_draws_fresh_noise():
  """steps_per_execution=3 under jit_compile=True with the compiled draw: the kernel and
  `iterations` set back, the same three steps again; all six charged."""
  model, opt = _model(jit=True, compiled=True, spe=3)
  kernel = model.layers[0].kernel
  x, y = _zeros(3 * B)
  start, counter = kernel.numpy().copy(), int(opt.iterations.numpy())
  model.fit(x, y, batch_size=B, epochs=1, verbose=0)
  first = kernel.numpy() - start
  kernel.assign(start)
  opt.iterations.assign(counter)
  model.fit(x, y, batch_size=B, epochs=1, verbose=0)
  second = kernel.numpy() - start
  assert abs(_corr(first, second)) < LIMIT
  assert int(opt.iterations.numpy()) == counter + 3
  assert int(opt.ledger.sample_count.numpy()) == 6


def _custom_loop():
  model = keras.Sequential([keras.Input((300,)), keras.layers.Dense(40)])
  opt = dp.keras.DPKerasSGDOptimizer(S, Z, learning_rate=1.0)
  opt.set_sampling(N, B / N, "poisson", B)
  x, y = (tf.constant(a) for a in _zeros())
  loss = lambda: tf.reduce_mean(tf.square(model(x, training=True) - y), axis=-1)
  return model, opt, loss


def test_a_custom_loop_step_retried_eagerly_is_charged_and_not_reused():
  """compute, an exception, compute again, apply: both noised results charged, the applied
  one fresh; the dropped one, or the applied one again, is refused."""
  model, opt, loss = _custom_loop()
  kernel = model.layers[0].kernel
  dropped = opt.compute_private_gradients(loss, model.trainable_variables, model=model)
  retried = opt.compute_private_gradients(loss, model.trainable_variables, model=model)
  start = kernel.numpy().copy()
  opt.apply_private_gradients(retried, model.trainable_variables)
  np.testing.assert_allclose(kernel.numpy() - start, -retried[0].numpy(), rtol=0, atol=1e-7)
  assert abs(_corr(dropped[0], retried[0])) < LIMIT
  assert int(opt.ledger.sample_count.numpy()) == 2 and int(opt.iterations.numpy()) == 1
  for grads in (dropped, retried):
    with pytest.raises(dp.errors.PrivacyConfigError, match="noised result"):
      opt.apply_private_gradients(grads, model.trainable_variables)
  assert int(opt.iterations.numpy()) == 1


def test_a_traced_custom_loop_step_that_fails_between_compute_and_apply():
  """An assertion failing after compute_private_gradients in the traced step: no update;
  the retry's update charged (the failed one's draw may be charged too: never fewer)."""
  model, opt, loss = _custom_loop()
  kernel = model.layers[0].kernel
  fail = tf.Variable(True)

  @tf.function
  def step():
    grads = opt.compute_private_gradients(loss, model.trainable_variables, model=model)
    with tf.control_dependencies([tf.debugging.assert_equal(fail, False, message="boom")]):
      grads = [tf.identity(g) for g in grads]
    opt.apply_private_gradients(grads, model.trainable_variables)

  start = kernel.numpy().copy()
  with pytest.raises(tf.errors.InvalidArgumentError, match="boom"):
    step()
  np.testing.assert_array_equal(kernel.numpy(), start)
  assert int(opt.iterations.numpy()) == 0
  fail.assign(False)
  step()
  assert int(opt.iterations.numpy()) == 1
  assert int(opt.ledger.sample_count.numpy()) >= 1


def _correlated(noise):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 30)).astype("float32")
  y = rng.normal(size=(64, 40)).astype("float32")
  kw = {"tree": dict(restart_every=2),
        "blt": dict(num_steps=64, num_buffers=2, min_separation=2)}[noise]
  model = dp.keras.DPSequential([keras.Input((30,)), keras.layers.Dense(40)])
  opt = dp.keras.DPKerasSGDOptimizer(0.01, 10.0, learning_rate=1.0, noise=noise, **kw)
  model.compile(opt, keras.losses.MeanSquaredError(), jit_compile=True, steps_per_execution=2)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if noise == "tree":
      ds = dp.data.shuffling.shuffled_batches(x, y, batch_size=32)   # 2 steps per pass
    else:
      ds = dp.data.cyclic_poisson_batches(x, y, expected_batch_size=16, num_groups=2,
                                          steps_per_epoch=2)
  return model, opt, ds


# all slow: tests/privacy/test_rollback_noise.py refuses a rolled-back BandMF and tree run by
# default
@pytest.mark.parametrize("noise, rollback", [
    pytest.param("blt", "load_weights", marks=pytest.mark.slow),
    pytest.param("blt", "iterations_assign", marks=pytest.mark.slow),
    pytest.param("tree", "load_weights", marks=pytest.mark.slow),
    pytest.param("tree", "iterations_assign", marks=pytest.mark.slow)])
def test_a_rolled_back_correlated_run_under_xla_is_refused(noise, rollback, tmp_path):
  """jit_compile=True, steps_per_execution=2: after the rollback the next fit releases and
  charges nothing (BLT: the cyclic sampler refuses eagerly; the tree: the step's assertion)."""
  model, opt, ds = _correlated(noise)
  kernel = model.layers[0].kernel
  model.fit(ds, epochs=1, verbose=0)
  path = str(tmp_path / "w.weights.h5")
  model.save_weights(path)
  start, counter = kernel.numpy().copy(), int(opt.iterations.numpy())
  model.fit(ds, epochs=1, verbose=0)
  if rollback == "load_weights":
    model.load_weights(path)
  else:
    kernel.assign(start)
    opt.iterations.assign(counter)
  assert int(opt.iterations.numpy()) == 2 and int(opt.ledger.sample_count.numpy()) == 4
  error = dp.errors.PrivacyConfigError if noise == "blt" else tf.errors.InvalidArgumentError
  with pytest.raises(error, match="rolled|rolled-back"):
    model.fit(ds, epochs=1, verbose=0)
  np.testing.assert_array_equal(kernel.numpy(), start)
  assert int(opt.ledger.sample_count.numpy()) == 4


def _hand_epsilon(steps, q=0.25, z=1.0, delta=1e-5):
  event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
  return dpa.rdp.RdpAccountant().compose(event).get_epsilon(delta)


@pytest.mark.parametrize("path", ["fit", "traced_custom_loop"])
def test_weights_copied_by_value_into_a_new_dp_model_keep_their_charge(path):
  """Trained 4 steps, copied by value, 1 step more: the copy's ledger charges all 5."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype("float32")
  y = rng.normal(size=(64, 3)).astype("float32")

  def dp_optimizer():
    return dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)

  trained = dp.keras.DPSequential([keras.Input((8,)), keras.layers.Dense(3)])
  trained.compile(dp_optimizer(), "mse")
  trained.fit(x, y, batch_size=16, epochs=1, verbose=0)   # 4 Poisson steps
  assert int(trained.optimizer.ledger.sample_count.numpy()) == 4
  if path == "fit":
    copy = dp.keras.DPSequential([keras.Input((8,)), keras.layers.Dense(3)])
    copy.compile(dp_optimizer(), "mse")
    copy.set_weights(trained.get_weights())
    copy.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=1, verbose=0)
    ledger = copy.optimizer.ledger
  else:   # a plain model's custom loop, its step traced before any record of the weights
    copy = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    copy.set_weights(trained.get_weights())
    opt = dp_optimizer()
    opt.set_sampling(64, 0.25, "poisson", 16)
    xb, yb = tf.constant(x[:16]), tf.constant(y[:16])
    loss = lambda: tf.reduce_mean(tf.square(copy(xb, training=True) - yb), axis=-1)
    weights = copy.trainable_variables

    @tf.function
    def step():
      opt.apply_private_gradients(
          opt.compute_private_gradients(loss, weights, model=copy), weights)

    with pytest.warns(FutureWarning, match="static batch size"):
      step()
    ledger = opt.ledger
  # at 2fa29e8: 1 sample, epsilon 3.08 (the copy's own step only)
  assert int(ledger.sample_count.numpy()) == 5
  assert dp.accounting.epsilon(ledger, 1e-5, accountant="rdp") == pytest.approx(
      _hand_epsilon(5), rel=1e-6)
