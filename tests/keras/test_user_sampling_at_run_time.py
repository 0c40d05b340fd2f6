"""A custom loop's step traced before a fit is not charged at fit's sampling afterwards
(review R5, finding 5): the user's declaration is checked when the step runs, not only when it
is traced.

Claim: a batch the user gives is charged under the sampling the user declared with
set_sampling, never under the one fit declared for its own sampler. Relation/unit: add/remove
one example, Poisson, z = 1, C = 1; unit = example. Before the fix, with the user's q = 0.5
(n = 100, batches of 50) and a fit at q = 0.1 in between, the step traced before the fit ran
again and recorded q = 0.1: rows q = [0.5, 0.1 x 11], epsilon 4.868 stated at delta 1e-5
where the steps taken (2 at q = 0.5, 10 at q = 0.1) give 5.952.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

import tf_dpiter as dp
from tests.keras import custom_loop_setup as loop


def _fit(model, x, y):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)


def _setup():
  x, y = loop.data()
  keras.utils.set_random_seed(0)
  inp = keras.Input((loop.D,))
  model = dp.keras.DPModel(inp, keras.layers.Dense(1)(inp))
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=loop.LR)
  model.compile(opt, "mse")
  opt.build(model.trainable_variables)
  opt.set_sampling(loop.N, 0.5, "poisson", 50)   # the user's own Poisson batches
  step = tf.function(loop.private_step(opt, loop.record_loss(model), model.trainable_variables))
  return x, y, model, opt, step


def _rows_q(opt):
  samples, _ = opt.ledger.get_arrays()
  return np.asarray(samples)[:, 1]


def test_a_step_traced_before_fit_is_not_charged_at_fits_sampling():
  x, y, model, opt, step = _setup()
  step(x[:50], y[:50])
  _fit(model, x, y)   # declares Poisson q = 0.1 for fit's own batches
  refused = False
  try:
    step(x[50:], y[50:])   # the user's batch again
  except (dp.errors.PrivacyConfigError, tf.errors.InvalidArgumentError):
    refused = True
  q = _rows_q(opt)
  assert q[0] == 0.5 and np.all(q[1:11] == 0.1)
  assert refused or (len(q) == 12 and q[-1] == 0.5), f"rows q={q.tolist()}"


def test_the_message_says_to_declare_again_and_retrace_and_a_new_trace_runs():
  x, y, model, opt, step = _setup()
  step(x[:50], y[:50])
  _fit(model, x, y)
  rows = int(opt.ledger.sample_count.numpy())
  w = [np.array(v) for v in model.trainable_variables]
  try:
    step(x[50:], y[50:])
    raise AssertionError("the step traced before fit ran under fit's sampling")
  except tf.errors.InvalidArgumentError as e:
    assert "set_sampling" in str(e) and "trace the step again" in str(e)
  # refused before the ledger write and the update
  assert int(opt.ledger.sample_count.numpy()) == rows
  assert all(np.array_equal(np.array(v), u) for v, u in zip(model.trainable_variables, w))
  opt.set_sampling(loop.N, 0.5, "poisson", 50)
  new_step = tf.function(loop.private_step(opt, loop.record_loss(model),
                                           model.trainable_variables))
  new_step(x[50:], y[50:])
  assert _rows_q(opt)[-1] == 0.5


def test_a_declaration_repeated_by_the_user_keeps_the_trace():
  """set_sampling again with the same values (a loop declaring each epoch): nothing the
  trace holds changed, so the traced step runs. Another q changes the public row bound the
  trace holds: refused until the step is traced again."""
  x, y, _, opt, step = _setup()
  step(x[:50], y[:50])
  opt.set_sampling(loop.N, 0.5, "poisson", 50)
  step(x[50:], y[50:])
  assert _rows_q(opt).tolist() == [0.5, 0.5]
  assert opt.set_sampling(loop.N, 0.4, "poisson", 40)   # True: the step must be retraced
  try:
    step(x[:50], y[:50])   # the traced shape: no retrace
    raise AssertionError("a step traced under another row bound ran")
  except tf.errors.InvalidArgumentError as e:
    assert "trace the step again" in str(e)
  assert _rows_q(opt).tolist() == [0.5, 0.5]
