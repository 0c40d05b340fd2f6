"""The clip shrink of an add/remove step does not depend on the batch's row count.

Casacuberta, Shoemate, Vadhan and Wagaman, "Widespread underestimation of sensitivity in
differentially private libraries and how to fix it" (CCS 2022), Secs. 3-5. Relation: add or
remove one example (Poisson sampling declared: population 257, q = 1); unit: the L2 norm of a
record's clipped gradient, C. An unpadded batch holds n = 256 rows on D' and n + 1 = 257 on
D = D' + r (r first: every other row shifts by one). With a shrink s(n) of the batch's own
rows the others' sum is scaled by s(256) on one and s(257) on the other (the pinned tree
gains a level at 257) and the float32 sum moved by 1.0078 C at 854cb19; the shrink now comes
from the public row bound (dp_query/summation.public_plan, keras/optimizer/chunking.
public_rows), the same on both.

Model: a bias-free Dense(1) from zero weights, x = 1, loss y * output, SGD lr 1, noise 0,
normalize=False: w0 - w1 is the step's float32 clipped sum. D' has 256 records of y = -10
(each clipped to -C), D adds one of y = +10 (+C). The independent float64 sums are -256 C and
-255 C: a move of exactly C, the ledger's sensitivity.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.dp_query import summation
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.optimizer import chunking
from tf_dpiter.ledger import policy_base

C, N, Y = 1.0, 257, 10.0
_SLOW = pytest.mark.slow


def _loss(y_true, y_pred):
  return tf.reduce_sum(y_true * y_pred, axis=-1)


def _rows(with_target):
  """(x, y) of D (with the target record r, first) or D'."""
  y = np.full(N - 1, -Y)
  if with_target:
    y = np.concatenate([[Y], y])
  return np.ones((len(y), 1), np.float32), y[:, None].astype(np.float32)


def _optimizer(clipping="auto"):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # noise 0: the no-noise warning
    opt = dp.keras.DPKerasSGDOptimizer(C, 0.0, learning_rate=1.0, clipping=clipping,
                                       normalize=False)
  return opt


def _model():
  keras.utils.set_random_seed(0)
  return dp.keras.DPSequential([keras.Input((1,)), keras.layers.Dense(
      1, use_bias=False, kernel_initializer="zeros")])


def _train_on_batch_sum(jit, clipping, with_target):
  model = _model()
  model.compile(optimizer=_optimizer(clipping), loss=_loss, jit_compile=jit)
  model.optimizer.set_sampling(N, 1.0, "poisson", N)
  model.train_on_batch(*_rows(with_target))
  return -model.get_weights()[0].astype(np.float64).ravel()


def _custom_loop_sum(form, with_target):
  model = _model()
  model.build((None, 1))
  opt = _optimizer()
  var = model.trainable_variables
  opt.build(var)
  opt.set_sampling(N, 1.0, "poisson", N)

  @tf.function(input_signature=[tf.TensorSpec([None, 1], tf.float32)] * 2)
  def step(x, y):   # the batch dim unknown to the trace: the rows known at run time only
    if form == "data":
      return opt.compute_private_gradients(
          lambda d: _loss(d[1], model(d[0], training=True)), var, data=(x, y), model=model)
    return opt.compute_private_gradients(lambda: _loss(y, model(x, training=True)), var,
                                         model=model)

  return step(*_rows(with_target))[0].numpy().astype(np.float64).ravel()   # the gradient


def _move(sum_fn):
  exact = abs(np.sum(np.clip(_rows(True)[1], -C, C).astype(np.float64))
              - np.sum(np.clip(_rows(False)[1], -C, C).astype(np.float64)))
  assert exact == C
  s_d, s_d2 = sum_fn(True), sum_fn(False)
  assert abs(s_d2[0] + 256 * C) < 256 * C * 1e-2, s_d2   # every record clipped, shrunk < 1%
  return float(np.linalg.norm(s_d - s_d2))


@pytest.mark.parametrize("jit,clipping", [
    (False, "vectorized"), (True, "vectorized"),
    pytest.param(False, "fast", marks=_SLOW), pytest.param(True, "fast", marks=_SLOW)])
def test_train_on_batch_of_n_and_n_plus_1_rows_moves_the_sum_by_at_most_C(jit, clipping):
  moved = _move(lambda t: _train_on_batch_sum(jit, clipping, t))
  assert 0.99 * C < moved <= C, moved


@pytest.mark.parametrize("form", ["data", pytest.param("losses", marks=_SLOW)])
def test_custom_loop_of_unknown_rows_moves_the_sum_by_at_most_C(form):
  moved = _move(lambda t: _custom_loop_sum(form, t))
  assert 0.99 * C < moved <= C, moved


class _Step:
  """What chunking.public_row_bound reads of a PrivateStep."""

  def __init__(self, policy, n, q, size=0):
    self.sampling = dp.ledger.LedgerSampling(n, q, policy=policy, sample_size=size)


def test_public_row_bound_is_twice_the_padded_size_under_add_remove_only():
  # E = 256, sd = 16: fit pads to 320 rows; the bound covers a sample padded to twice that
  assert chunking.public_row_bound(_Step("poisson", 60000, 256 / 60000)) == 640
  assert chunking.public_row_bound(_Step("shuffle", 60000, 256 / 60000, 256)) is None
  # formed by the declaration (a number the step reads), again by a new one
  sampling = _Step("poisson", 60000, 256 / 60000).sampling
  assert sampling.public_row_bound == 640 == 2 * dp.data.default_max_batch_size(60000, 256 / 60000)
  sampling.set_sampling(6000, 256 / 6000)   # E 256, sd 15.5: 320 rows padded
  assert sampling.public_row_bound == 2 * dp.data.default_max_batch_size(6000, 256 / 6000)
  sampling.set_sampling(60000, 512 / 60000)   # E 512, sd 22.5: 608 rows padded
  assert sampling.public_row_bound == 1216


def test_public_row_bound_is_fixed_at_declaration_not_by_the_traced_batch(monkeypatch):
  """The plan every trace of the step takes its clip shrink from has the declared bound's
  rows, whatever batch (8, 13, 5 rows) is traced; no trace forms the bound (forming it
  raises while the steps run); a declaration of another q asks for a retrace and forms it
  again, one of the same n and q does not."""
  model = _model()
  model.compile(optimizer=_optimizer("vectorized"), loss=_loss)
  opt = model.optimizer
  assert opt.set_sampling(64, 8 / 64, "poisson", 8) is True   # a new sampling
  declared = opt.private_step.sampling.public_row_bound
  assert declared == 2 * dp.data.default_max_batch_size(64, 8 / 64) == 48
  plans, real = [], summation.public_plan

  def spy(*args, **kwargs):
    plans.append(args[0])
    return real(*args, **kwargs)

  def formed(*args, **kwargs):
    raise AssertionError("the public row bound was formed by a step")

  with monkeypatch.context() as patch:
    patch.setattr(summation, "public_plan", spy)
    patch.setattr(policy_base.SamplingPolicy, "public_row_bound", formed)
    patch.setattr(policy_base, "default_max_batch_size", formed)
    for rows in (8, 13, 5):   # traced batches of three sizes (Keras retraces on a new one)
      x = np.ones((rows, 1), np.float32)
      model.train_on_batch(x, -x)
  assert plans and set(plans) == {declared}, plans
  assert opt.set_sampling(64, 8 / 64, "poisson", 8) is False   # same n, q: same bound
  assert opt.set_sampling(64, 32 / 64, "poisson", 32) is True   # E 32: formed again
  assert opt.private_step.sampling.public_row_bound == 2 * dp.data.default_max_batch_size(
      64, 32 / 64) == 96


def test_rows_past_the_public_bound_fail_the_step():
  with summation.public_plan(8, 8, 1):
    assert summation.public_shrink(8, 8) == summation.public_shrink(3, 3)   # one shrink
    with pytest.raises(PrivacyConfigError, match="rows"):
      summation.public_shrink(9, 9)

    @tf.function(input_signature=[tf.TensorSpec([], tf.int32)])
    def shrink_of(rows):
      return summation.public_shrink(rows, rows)

    assert shrink_of(tf.constant(5)).numpy() == summation.public_shrink(8, 8)
    with pytest.raises(tf.errors.InvalidArgumentError, match="public bound"):
      shrink_of(tf.constant(9))

  @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([None], tf.float32)])
  def shrink_xla(mask):   # XLA drops the assertion: the shrink is NaN past the bound
    with summation.public_plan(8, 8, 1):
      return summation.public_shrink(tf.shape(mask)[0], tf.shape(mask)[0])

  assert np.isfinite(shrink_xla(tf.ones([8])).numpy())
  assert np.isnan(shrink_xla(tf.ones([9])).numpy())
