"""Review R13 (session 44) of the keyed random layers
(tf_dpiter.keras.optimizer.private_step.PrivateStep.keyed_layer_draws): findings, each a
test that runs the real step with noise off and measures the violation. All three were strict
xfails and are fixed in session 44: finding 1 by keying the layers the loss reaches
(custom_loops._random_layers), finding 2 by refusing grouped shared draws and one padded chunk
under XLA (PrivateStep.refuse_grouped_draws), finding 3 by restoring the states in a finally.

Relation and unit: add/remove one example under Poisson sampling declared with
`optimizer.set_sampling(N, q, "poisson")`, C = 1, lr 1, noise off (z = 0). The harness is
tests/keras/test_keyed_layer_draws.py's: record i is the one-hot row 10 e_i, a Dropout(0.5)
before a Dense(1, no bias, zero kernel), the label 1e4, so record i adds C e_i (its mask kept
feature i) or nothing to the clipped sum, and entry i of the private average is C / (q N) or
0. One record may move the average by at most C / (q N) = 0.125.

Finding 1. The custom loop keys only the SeedGenerators of `model=`
(custom_loops._keyed_layer_draws, session 44's first form). A random layer the loss runs that `model=` does not hold
(an augmentation or Dropout applied to the inputs in loss_fn, a second model such as a head
whose random layers the loss calls) keeps drawing from its own seeded state, by row
position, and the call is not refused. Measured (N 16, seed 1, load ~3-5):
||g(D) - g(D')|| = 0.3535 against 0.125 (2.8 times), the same masks on every run of the
same seed, eager and inside tf.function, form (b) (a callable loss). The data= form with
the same outside layer stays within the bound (0.125: each record's own pass). Fit's
train_step overrides refuse such layers for their position (CHANGELOG, session 41 checks).

Finding 2 (physical chunks group the records' shared draws by position) and finding 3 (fixed:
an eager step failing inside the keyed block left the key in the states) are below.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

N = 16
Q = 0.5
C = 1.0
STEP = C / (Q * N)   # the most one record may move the private average (lr 1)
RATE = 0.5


def _loop_with_outside_dropout():
  """A plain Keras model Dense(1, no bias, zeros) (the `model=` of the call), a seeded
  Dropout(RATE, seed=1) outside it (an input augmentation), and a DP optimizer (C, z = 0,
  the user's Poisson sampling, q of N)."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((N,)),
                            keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
  augment = keras.layers.Dropout(RATE, seed=1)
  opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0)
  opt.set_sampling(N, Q, "poisson")
  return model, augment, opt


def _average(records, traced):
  """The private average (noise off) of one compute_private_gradients call on `records`,
  the loss a callable running the outside Dropout then `model` (form (b), model=model);
  as entry i of the kernel's descent direction."""
  model, augment, opt = _loop_with_outside_dropout()
  x = tf.constant(10.0 * np.eye(N, dtype="float32")[list(records)])
  y = tf.constant(np.full((len(records), 1), 1e4, "float32"))

  def losses():
    out = model(augment(x, training=True), training=True)
    return tf.reduce_mean(tf.square(y - out), axis=-1)

  def call():
    return opt.compute_private_gradients(losses, model.trainable_variables, model=model)

  grads = tf.function(call)() if traced else call()
  return -np.asarray(grads[0])[:, 0]


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("traced", [
    pytest.param(False, id="eager"),
    pytest.param(True, id="tf_function", marks=pytest.mark.slow)])
def test_a_random_layer_outside_model_is_keyed_or_refused(traced):
  """Either the call is refused (PrivacyConfigError), or the outside layer's masks do not
  follow the user's seed: two runs of one seed on D draw different masks. With the
  positional seeded masks the neighbouring averages differ by 0.3535 every run."""
  try:
    full = _average(range(N), traced)
    again = _average(range(N), traced)
    less = _average(range(1, N), traced)
  except dp.errors.PrivacyConfigError:
    return
  moved = float(np.linalg.norm(full - less))
  assert not np.array_equal(full, again), (
      f"the masks follow the user's seed (by row): ||g(D) - g(D')|| = {moved:.4f} against "
      f"C / (q N) = {STEP}")


# Finding 2: physical chunks group the records' shared draws by position.
#
# A draw shared by the rows of one forward (the vectorized path's: tf.vectorized_map runs
# each record as a batch of one, so every record gets the same mask; on the fast path a
# Dropout with noise_shape=(1, ...) or any draw not of the batch's size) is shared by the
# whole batch without physical chunks: one record then moves the sum by at most C. Under
# max_physical_batch_size each chunk's forward advances the keyed state, so the records of
# one chunk share a draw and the chunks' draws differ: which records share a draw is a
# function of their positions, which one removed record shifts.
#
# Harness: one feature x = 10, Dropout(0.5) (a scalar mask per row), Dense(1, no bias, zero
# kernel), record i's label s_i 1e4 (s_i = +1 or -1): record i adds s_i C or nothing, as its
# mask keeps or drops the feature. N = 4 declared, q = 0.5: STEP = C / (q N) = 0.5, lr 1.
# Chunks of 2 rows. D = (+, +, -, -): chunks {+, +} {-, -}, so w(D) / STEP = 2 (m1 - m2),
# 2 with probability 1/4. D' = D without its first record = (+, -, -): chunks {+, -} {-},
# w(D') / STEP = -m2 <= 0 always. No coupling of w(D) and w(D') moves by at most STEP
# (w(D) = 2 STEP has no w(D') within STEP of it): the step's sensitivity is 2 C, not C,
# k C with chunks of k. Measured (30 steps each, load ~3-5): w(D) / STEP took -2, 0, 2,
# w(D') / STEP took -1, 0, on the vectorized path and on the fast path with noise_shape
# (1, 1); without max_physical_batch_size w(D) / STEP is always 0 (one shared mask).
# Per-row masks (noise_shape None, fast path) are i.i.d. across rows and chunks: sound.

N2, Q2 = 4, 0.5
STEP2 = C / (Q2 * N2)
RUNS = 60   # P(w(D) never reaches 2 STEP under the defect) = (3/4)^60, about 3e-8


def _chunked_model(clipping, noise_shape):
  """DP model Dropout(0.5, noise_shape) -> Dense(1, no bias, zeros) on one feature, SGD
  (lr 1, C, z = 0), physical chunks of 2 rows, Poisson sampling q of N2 declared."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([
      keras.Input((1,)), keras.layers.Dropout(0.5, noise_shape=noise_shape),
      keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
  opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0, clipping=clipping,
                                     max_physical_batch_size=2)
  model.compile(opt, "mse")
  opt.set_sampling(N2, Q2, "poisson")
  return model


def _updates(model, signs):
  """w / STEP2 after one step from a zero kernel, for RUNS steps of the batch `signs`."""
  x = np.full((len(signs), 1), 10.0, "float32")
  y = np.asarray(signs, "float32")[:, None] * 1e4
  kernel = model.layers[-1].kernel
  out = []
  for _ in range(RUNS):
    kernel.assign(tf.zeros_like(kernel))
    model.train_on_batch(x, y)
    out.append(float(kernel.numpy()[0, 0]) / STEP2)
  return np.array(out)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("clipping,noise_shape", [
    pytest.param("vectorized", None, id="vectorized"),
    pytest.param("fast", (1, 1), id="fast-batch_shared_mask", marks=pytest.mark.slow)])
def test_physical_chunks_do_not_group_shared_draws_by_position(clipping, noise_shape):
  """Either refused (PrivacyConfigError), or no value of w(D) lies more than STEP above
  every value w(D') takes: w(D') <= 0 always here (D' = (+, -, -)), so w(D) must stay
  <= STEP; it reaches 2 STEP with probability 1/4 a step under the defect."""
  try:
    model = _chunked_model(clipping, noise_shape)
    with_first = _updates(model, [1, 1, -1, -1])
    without = _updates(model, [1, -1, -1])
  except dp.errors.PrivacyConfigError:
    return
  np.testing.assert_array_less(without, 1e-3)   # w(D') <= 0: the harness holds
  assert with_first.max() <= 1.0 + 1e-3, (
      f"w(D) / STEP took {sorted(set(np.round(with_first, 3)))}, w(D') / STEP "
      f"{sorted(set(np.round(without, 3)))}: one record moved the update by 2 C / (q N)")



@pytest.mark.slow   # the custom loop's form of finding 2
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_custom_loop_chunks_do_not_group_shared_draws_by_position():
  """Finding 2's harness in a custom loop (form (a), data= with model=, unseeded Dropout,
  keyed by the step): either refused, or g(D) / STEP stays <= 1 when g(D') <= 0."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((1,)), keras.layers.Dropout(0.5),
                            keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
  opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0, max_physical_batch_size=2)
  opt.set_sampling(N2, Q2, "poisson")

  def losses(d):
    return tf.reduce_mean(tf.square(d[1] - model(d[0], training=True)), axis=-1)

  def averages(signs):
    x = tf.constant(np.full((len(signs), 1), 10.0, "float32"))
    y = tf.constant(np.asarray(signs, "float32")[:, None] * 1e4)
    call = tf.function(lambda: opt.compute_private_gradients(
        losses, model.trainable_variables, data=(x, y), model=model)[0])
    return np.array([-float(call().numpy()[0, 0]) / STEP2 for _ in range(RUNS)])

  try:
    with_first, without = averages([1, 1, -1, -1]), averages([1, -1, -1])
  except dp.errors.PrivacyConfigError:
    return
  np.testing.assert_array_less(without, 1e-3)
  assert with_first.max() <= 1.0 + 1e-3, (
      f"g(D) / STEP took {sorted(set(np.round(with_first, 3)))}, g(D') / STEP "
      f"{sorted(set(np.round(without, 3)))}")

# Finding 3 (fixed: keyed_layer_draws puts the states back in a `finally`): an eager step
# that failed inside the keyed block left the step's secret key in the layers' SeedGenerator
# states (they were put back only on a normal exit).
# Only a failed step's key, whose update was never applied, so no record is exposed; but the
# user's state is lost and a model saved after the caught error holds the key. Measured
# (run_eagerly=True, a layer raising in its call after the Dropout): state [1 0] before, a
# pair of secret 64-bit words after.


class _FailsWhenTold(keras.layers.Layer):
  """Identity, or a RuntimeError from its call while `fail` is set."""

  fail = False

  def call(self, x, training=None):
    if self.fail:
      raise RuntimeError("failed inside the keyed block")
    return x


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_failed_eager_step_puts_the_users_seed_state_back():
  keras.utils.set_random_seed(0)
  failing = _FailsWhenTold()
  model = dp.keras.DPSequential([
      keras.Input((N,)), keras.layers.Dropout(RATE, seed=1), failing,
      keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
  opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0)
  model.compile(opt, "mse", run_eagerly=True)
  opt.set_sampling(N, Q, "poisson")
  x = 10.0 * np.eye(N, dtype="float32")
  y = np.full((N, 1), 1e4, "float32")
  model.train_on_batch(x, y)
  state = model.layers[0].seed_generator.state
  before = state.numpy().copy()
  failing.fail = True
  with pytest.raises(RuntimeError, match="failed inside the keyed block"):
    model.train_on_batch(x, y)
  np.testing.assert_array_equal(state.numpy(), before)


# Finding 2's fix beyond max_physical_batch_size: under jit_compile=True a padded Poisson
# sample is split into a first chunk and tail chunks (chunking.PaddedTail) with no physical
# size declared; with keyed random layers the step takes it as one padded chunk instead, so
# no draw a chunk shares is grouped by position. Per-row draws (Dropout's default noise
# shape on the fast path) stay i.i.d. across chunks, so max_physical_batch_size is not
# refused for them.
_E, _N, _M = 16, 1000, 48   # test_xla_padded_tail's sizes: PaddedTail(16, 8) without dropout


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("clipping,dropout,expected", [
    ("vectorized", True, [None]), ("vectorized", False, [(16, 8)]), ("fast", True, [None])])
def test_keyed_random_layers_take_the_padded_sample_as_one_chunk(clipping, dropout, expected,
                                                                 monkeypatch):
  from tf_dpiter.keras.optimizer import chunking  # pylint: disable=g-import-not-at-top
  layouts = []
  layout_fn = chunking.chunk_layout
  monkeypatch.setattr(chunking, "chunk_layout", lambda *a, **k: layouts.append(
      layout_fn(*a, **k)) or layouts[-1])
  keras.utils.set_random_seed(1)
  model = dp.keras.DPSequential(
      [keras.Input((6,))] + ([keras.layers.Dropout(0.5)] if dropout else [])
      + [keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0,
                                                       clipping=clipping),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=True)
  model.optimizer.set_sampling(_N, _E / _N, "poisson", _E)
  rng = np.random.RandomState(0)
  w = np.zeros(_M, "float32")
  w[:21] = 1.0
  model.train_on_batch(rng.randn(_M, 6).astype("float32"), rng.randint(0, 3, _M), sample_weight=w)
  assert [None if t is None else tuple(t) for t in layouts] == expected


def test_per_row_draws_in_physical_chunks_train_on_the_fast_path():
  """Dropout's default noise shape on the fast path: one draw per row, fresh keys at each
  chunk, i.i.d. across records: max_physical_batch_size is not refused, and every record
  adds C or nothing (a record's norm and sum from one forward)."""
  model = _chunked_model("fast", None)
  out = _updates(model, [1, 1, -1, -1])
  assert np.all(np.isfinite(out))
  assert np.all(np.abs(out) <= 2.0 + 1e-3)   # two positive records at most: 2 STEP
