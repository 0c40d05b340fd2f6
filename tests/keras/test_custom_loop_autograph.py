"""A custom loop's loss_fn goes through AutoGraph as the caller's code; the library does not.

Claim (custom_loops.compute_private_gradients): inside a user's
`tf.function` (autograph=True, the default) the user's loss_fn is converted, so Python
control flow on tensors in it (`if tf.reduce_sum(x) > 0:`, `for _ in tf.range(n):`) becomes
graph control flow, in both forms (data= and the loss_fn() of the batch); eagerly it runs as
it is, and under autograph=False it is not converted (Python control flow on a symbolic
tensor is refused by TensorFlow, as before). The library's own functions on the path
(the checks, the clipped sum, the update) are not converted: converting them cost a custom
loop's trace about 40 % of its Python time (benchmarks/SUITE_CUTS.md, session 44).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
# private: the one function through which AutoGraph converts an entity (observed, not changed)
from tensorflow.python.autograph.impl import api as autograph_api

import tf_dpiter as dp

B = 4
X = np.arange(B * 2, dtype=np.float32).reshape(B, 2) / 10.0 + 0.1
Y = np.ones((B, 1), np.float32)
# the entry points a user's converted code calls: converted (they hand loss_fn on converted)
ENTRY_POINTS = {"DPOptimizerBase.compute_private_gradients", "compute_private_gradients"}


def _setup():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")])
  # clip 100: no example is clipped; noise std 1e-10: the result is the mean gradient
  opt = dp.keras.DPKerasSGDOptimizer(100.0, 1e-12, learning_rate=0.1)
  opt.set_sampling(100, B / 100, "poisson", B)
  return model, opt


def _branchy(loss, x):
  if tf.reduce_sum(x) > 0:   # a tensor's value: AutoGraph's tf.cond
    loss = loss * 2.0
  else:
    loss = loss * 3.0
  for _ in tf.range(2):   # a tensor range: AutoGraph's while loop
    loss = loss * 1.5
  return loss


def _step(opt, model, form, x, y):
  variables = model.trainable_variables
  if form == "data":
    grads = opt.compute_private_gradients(
        lambda r: _branchy(keras.losses.mean_squared_error(r[1], model(r[0])), r[0]),
        variables, data=(x, y))
  else:
    grads = opt.compute_private_gradients(
        lambda: _branchy(keras.losses.mean_squared_error(y, model(x)), x), variables,
        model=model)
  opt.apply_private_gradients(grads, variables)
  return grads


def _mean_gradient(x, factor, weights=None):
  """The gradient of the mean over the batch of factor * (y - w x - b)^2, by a tape, at
  `weights` (None: the initial ones)."""
  model, _ = _setup()
  for v, w in zip(model.trainable_variables, weights or ()):
    v.assign(w)
  with tf.GradientTape() as tape:
    loss = factor * tf.reduce_mean(keras.losses.mean_squared_error(Y, model(x)))
  return tape.gradient(loss, model.trainable_variables)


@pytest.mark.parametrize("form", ["data", "losses"])
def test_the_loss_fn_is_converted_as_the_callers_code_and_the_library_is_not(form, monkeypatch):
  converted = []
  convert = autograph_api._convert_actual  # pylint: disable=protected-access
  monkeypatch.setattr(autograph_api, "_convert_actual",
                      lambda entity, ctx: (converted.append(entity), convert(entity, ctx))[1])
  model, opt = _setup()
  spec = (tf.TensorSpec([B, 2]), tf.TensorSpec([B, 1]))
  step = tf.function(lambda a, b: _step(opt, model, form, a, b), input_signature=spec)
  for sign, factor in ((1.0, 2.0 * 2.25), (-1.0, 3.0 * 2.25)):   # each branch, at run time
    before = [v.numpy() for v in model.trainable_variables]
    got = step(sign * X, Y)
    model_at = [v.numpy() for v in model.trainable_variables]
    want = _mean_gradient(sign * X, factor, before)
    for g, w, b, a in zip(got, want, before, model_at):
      np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-6)
      np.testing.assert_allclose(a, b - 0.1 * g.numpy(), rtol=1e-6, atol=1e-7)   # applied
  assert step.experimental_get_tracing_count() == 1
  names = [getattr(e, "__qualname__", "") for e in converted]
  assert "_branchy" in names
  # the library's functions (not the closures its own tf.function traces enter by, converted
  # as any tf.function's: a few lines each, once per process)
  library = {getattr(e, "__qualname__", repr(e)) for e in converted
             if getattr(e, "__module__", "").startswith("tf_dpiter")
             and "<locals>" not in getattr(e, "__qualname__", "")}
  assert library <= ENTRY_POINTS, library - ENTRY_POINTS

  # eagerly, the loss_fn runs as it is (Python control flow on eager tensors)
  model, opt = _setup()
  got = _step(opt, model, form, tf.constant(X), tf.constant(Y))
  for g, w in zip(got, _mean_gradient(X, 2.0 * 2.25)):
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-6)

  # autograph=False: the loss_fn is not converted, as before
  model, opt = _setup()
  plain = tf.function(lambda a, b: _step(opt, model, form, a, b), autograph=False)
  with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
    plain(tf.constant(X), tf.constant(Y))

