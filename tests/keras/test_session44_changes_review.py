"""Review R15 (session 45) of session 44's custom-loop AutoGraph, step-trace and fingerprint
changes: each suspected defect as a test that runs the real step and measures it.

Relation and unit (the keyed-draws harness of tests/keras/test_keyed_layer_draws_review.py):
add/remove one example under Poisson sampling declared with `optimizer.set_sampling(N, q,
"poisson")`, C = 1, lr 1, noise off (z = 0). Record i is the one-hot row 10 e_i, a seeded
Dropout(0.5) outside `model=` (an input augmentation the loss runs) before a Dense(1, no
bias, zero kernel), the label 1e4: record i adds C e_i (its mask kept feature i) or nothing
to the clipped sum, so one record may move the private average by at most C / (q N) = 0.125.

Finding 1 (fab40fb, custom loop AutoGraph). Inside a user's tf.function,
compute_private_gradients hands on loss_fn as AutoGraph's tf_convert wrapper of a
functools.partial of it, and the random layers the loss reaches outside `model=` are then
looked for in that wrapper (custom_loops._random_layers -> keras_internals.closure_layers,
"up to 3 levels" of nested functions): the wrapper is one level more, so a layer the loss
reaches through two helper functions (loss -> helper -> inner -> Dropout) is found and keyed
eagerly but not inside tf.function. Unkeyed, its seeded masks follow the rows' positions:
||g(D) - g(D')|| = 0.3535 against C / (q N) = 0.125 (N 16, seed 1; every run of the seed).
Fixed: closure_layers follows a decorator's `__wrapped__` at the same level.

Finding 2 (2805179, the keyed layers the loss reaches). A loss_fn that is itself a
tf.function (`@tf.function def losses(): ...`, passed to an eager or traced call) is a
PolymorphicFunction object, not a Python function: closure_layers finds none of the layers
it reaches, so a seeded Dropout outside `model=` draws by row position, not refused:
||g(D) - g(D')|| = 0.3535 against 0.125. Fixed: closure_layers follows a tf.function's
python_function at the same level.

Finding 3 (the public row bound under XLA, pre-existing) and a negative result on the frozen
variables' kept fingerprints (52cd9b2) are below.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

N = 16
Q = 0.5
C = 1.0
STEP = C / (Q * N)   # the most one record may move the private average (lr 1)


def _loop():
  """Dense(1, no bias, zeros) (`model=`), a seeded Dropout(0.5) outside it, a DP SGD (C,
  z = 0, the user's Poisson sampling q of N)."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((N,)),
                            keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
  augment = keras.layers.Dropout(0.5, seed=1)
  opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0)
  opt.set_sampling(N, Q, "poisson")
  return model, augment, opt


def _nested_average(records, traced, loss_form="helpers"):
  """The private average (noise off) of one call on `records`, form (b), the loss reaching
  the outside Dropout through two helper functions (three levels of nested functions), or
  (loss_form "tf_function") directly, the loss_fn a tf.function."""
  model, augment, opt = _loop()
  x = tf.constant(10.0 * np.eye(N, dtype="float32")[list(records)])
  y = tf.constant(np.full((len(records), 1), 1e4, "float32"))

  def inner(t):
    return augment(t, training=True)

  def helper(t):
    return model(inner(t), training=True)

  def losses():
    return tf.reduce_mean(tf.square(y - helper(x)), axis=-1)

  if loss_form == "tf_function":
    losses = tf.function(lambda: tf.reduce_mean(
        tf.square(y - model(augment(x, training=True), training=True)), axis=-1))

  step = functools.partial(opt.compute_private_gradients, losses, model.trainable_variables,
                           model=model)
  return -np.asarray((tf.function(step) if traced else step)()[0])[:, 0]


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("traced,loss_form", [
    pytest.param(False, "helpers", id="helpers-eager", marks=pytest.mark.slow),
    pytest.param(True, "helpers", id="helpers-tf_function"),   # finding 1
    pytest.param(False, "tf_function", id="tf_function_loss")])   # finding 2
def test_a_random_layer_outside_model_is_keyed_however_the_loss_reaches_it(traced, loss_form):
  """Either refused, or the outside layer's masks do not follow the user's seed: two runs of
  one seed on D draw different masks (the measured neighbouring move is in the message)."""
  run = functools.partial(_nested_average, traced=traced, loss_form=loss_form)
  try:
    first, second = run(range(N)), run(range(N))
  except dp.errors.PrivacyConfigError:
    return
  moved = np.linalg.norm(first - run(range(1, N)))
  assert not np.array_equal(first, second), (
      f"seeded masks by row position ({loss_form}, traced={traced}): ||g(D) - g(D')|| = "
      f"{moved:.4f} against C / (q N) = {STEP}")


# Finding 3 (not a session 44 change; the brief's question on 25720c1's unguarded Assert).
# The public row bound of an add/remove step (summation.within_public_rows: twice the padded
# size of the declared Poisson sample) is a run-time assertion, and XLA drops assertions, so
# its callers also make the step's result NaN. fit's fast path checks the batch only in
# chunking.sum_over_chunks, by a control dependency on that assertion: under jit_compile=True
# a batch past the bound is neither refused nor NaN. Measured: set_sampling(64, 8 / 64,
# "poisson") (bound 48), a fit of one batch of 60 rows of unknown size (tf.data batch),
# noise off, C = 1, lr 1, normalize=False, every record's gradient clipped to C: the weight
# moved by 59.99 (the 60 records' sum) where the vectorized path's weight is NaN and graph
# mode raises InvalidArgumentError; the same before 25720c1 (the guarded assertion).
# Fixed: under XLA sum_over_chunks makes its sums NaN past the bound.

def _fit_past_the_row_bound(clipping, jit):
  """The weight after a fit of one batch of 60 rows (bound 48), or None when refused."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([
      keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
  with pytest.warns(UserWarning):   # noise 0
    opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0, clipping=clipping,
                                       normalize=False)
  model.compile(optimizer=opt, loss=lambda yt, yp: tf.reduce_sum(yt * yp, axis=-1),
                jit_compile=jit)
  opt.set_sampling(64, 8 / 64, "poisson")
  assert opt.private_step.sampling.public_row_bound == 48
  rows = np.ones((60, 1), np.float32)
  try:
    model.fit(tf.data.Dataset.from_tensor_slices((rows, -rows)).batch(60), verbose=0)
  except tf.errors.InvalidArgumentError as e:
    assert "public bound" in str(e)
    return None
  return float(model.get_weights()[0].ravel()[0])


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("clipping,jit", [
    pytest.param("fast", True, id="fast-xla"),
    pytest.param("vectorized", True, id="vectorized-xla", marks=pytest.mark.slow),
    pytest.param("fast", False, id="fast-graph", marks=pytest.mark.slow)])
def test_a_batch_past_the_public_row_bound_updates_nothing_finite(clipping, jit):
  """Refused (graph mode) or a NaN update (XLA drops the assertion)."""
  moved = _fit_past_the_row_bound(clipping, jit)
  assert moved is None or not np.isfinite(moved), (
      f"a batch of 60 rows past the public bound 48 moved the weight by {moved}")


# Negative result (52cd9b2, a frozen variable keeps its kept buffer through the DP update): a
# kept digest stands for the variable only while its buffer is the one digested, and every
# write between two DP train_on_batch calls below made a new buffer (copy-on-write of a held
# buffer: XLA does not donate it, a sparse update copies it), so each was refused, as was a
# plain optimizer's update of the layer unfrozen for it and frozen again.

def _frozen_writers():
  """name -> a function writing the (frozen) variable outside the DP optimizer."""
  sgd = keras.optimizers.SGD(0.1)

  def plain_update(v, layer):
    layer.trainable = True
    sgd.apply_gradients([(tf.ones_like(v), v)])
    layer.trainable = False

  return {
      "xla_assign_add": lambda v, _: tf.function(
          lambda: v.assign_add(tf.ones_like(v)), jit_compile=True)(),
      "traced_scatter": lambda v, _: tf.function(
          lambda: v.scatter_nd_add([[0, 0]], [1.0]))(),
      "unfrozen_plain_update": plain_update,
  }


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_a_frozen_variable_written_between_dp_steps_is_refused():
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(4, name="frozen"),
                                 keras.layers.Dense(1)])
  frozen_layer = model.get_layer("frozen")
  frozen_layer.trainable = False
  model.compile(dp.keras.DPKerasSGDOptimizer(C, 1.0, learning_rate=0.1), "mse")
  model.optimizer.set_sampling(100, 0.1, "poisson", 10)
  x, y = np.ones((10, 3), np.float32), np.ones((10, 1), np.float32)
  model.train_on_batch(x, y)
  model.train_on_batch(x, y)
  kernel = frozen_layer.kernel
  for name, write in _frozen_writers().items():
    old = np.array(kernel)
    write(kernel.value if hasattr(kernel, "value") else kernel, frozen_layer)
    assert not np.array_equal(np.array(kernel), old), name
    with pytest.raises(dp.errors.PrivacyConfigError, match="train_on_batch refused"):
      model.train_on_batch(x, y)
    kernel.assign(old)   # a recorded state put back: accepted
    model.train_on_batch(x, y)
