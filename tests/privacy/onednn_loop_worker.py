"""Runs every custom-loop form of the private step with noise 0 (the output is the pre-noise
clipped sum) and prints one line "RESULT {json}": per "model:form", the largest change of the
clipped sum when one example is removed or an adversarial one is added, in units of the
recorded sensitivity, and the largest deviation from a per-example reference sum; or
"refused" with the message (test_custom_loop_onednn calls `results` in its own process when
that process already runs oneDNN, else runs this script with TF_ENABLE_ONEDNN_OPTS=1 in a
subprocess).

Models: "einsum" (MultiHeadAttention + 3-D EinsumDense: the layers whose vectorized
per-example gradients oneDNN breaks), "bn" (a BatchNormalization in training mode) and
"centering" (a weightless layer subtracting the batch mean): the last two mix the examples of
a batch. Forms, each also with the suffix "_model" (model= passed):
  data           optimizer.compute_private_gradients(loss_of_one_record, vars, data=(x, y))
  vector         optimizer.compute_private_gradients(lambda: losses_of_the_batch, vars)
  tape           optimizer.compute_private_gradients(losses, vars, tape=tape)
  minimize       VectorizedDPKerasSGDOptimizer(...).minimize(lambda: losses, vars)
  minimize_tape  make_keras_optimizer_class(SGD)(...).minimize(losses, vars, tape=tape)
The minimize forms (TF Privacy's spellings, learning rate 1, no momentum) give the sum as the
weights' change; the weights are restored after each call.

usage: onednn_loop_worker.py [MODEL:FORM | paths:onednn ...]
"""

import importlib.util
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dpiter as dp  # noqa: E402
from tf_dpiter.keras import compat  # noqa: E402
from tf_dpiter.keras.optimizer import routing  # noqa: E402

CLIP, B = 0.05, 6
BASE_FORMS = ("data", "vector", "tape", "minimize", "minimize_tape")
FORMS = tuple(f + s for f in BASE_FORMS for s in ("", "_model"))
SHAPE = (5, 8)


class BatchCentering(keras.layers.Layer):
  """Subtracts the batch mean: mixes the examples of a batch, and has no weights."""

  def call(self, h):
    return h - keras.ops.mean(h, axis=0, keepdims=True)


def _model(kind):
  keras.utils.set_random_seed(0)
  inp = keras.Input(SHAPE)
  if kind == "einsum":
    h = keras.layers.MultiHeadAttention(2, 4, name="mha")(inp, inp)
    h = keras.layers.EinsumDense("btd,dk->btk", output_shape=(5, 3), name="einsum")(h)
  else:
    h = keras.layers.Dense(4, activation="tanh")(inp)
    h = (keras.layers.BatchNormalization(name="bn")(h) if kind == "bn"
         else BatchCentering(name="centering")(h))
  return keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(h)))


def _losses(model, x, y):
  return keras.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                      from_logits=True)


def _optimizer(form):
  if form.startswith("minimize_tape"):
    cls = compat.make_keras_optimizer_class(keras.optimizers.SGD)
  elif form.startswith("minimize"):
    cls = compat.VectorizedDPKerasSGDOptimizer
  else:
    cls = dp.keras.DPKerasSGDOptimizer
  opt = cls(CLIP, 0.0, normalize=False, learning_rate=1.0)
  opt.set_sampling(1000, B / 1000, "poisson")
  return opt


def _grads(opt, model, form, given, x, y, mask):
  variables = model.trainable_variables
  if form.startswith("data"):
    return opt.compute_private_gradients(lambda d: _losses(model, d[0], d[1]), variables,
                                         data=(x, y), mask=mask, model=given)
  if form.startswith("vector"):
    return opt.compute_private_gradients(lambda: _losses(model, x, y), variables, mask=mask,
                                         model=given)
  with tf.GradientTape(persistent=True) as tape:
    losses = _losses(model, x, y)
  return opt.compute_private_gradients(losses, variables, mask=mask, tape=tape, model=given)


def _minimize(opt, model, form, given, x, y, mask):
  """The weights' change of one minimize step (= minus the sum at learning rate 1)."""
  variables = model.trainable_variables
  before = [tf.identity(v) for v in variables]
  if form.startswith("minimize_tape"):
    with tf.GradientTape(persistent=True) as tape:
      losses = _losses(model, x, y)
    opt.minimize(losses, variables, tape=tape, mask=mask, model=given)
  else:
    opt.minimize(lambda: _losses(model, x, y), variables, mask=mask, model=given)
  change = [b - v for b, v in zip(before, variables)]
  with tf.control_dependencies(change):
    for b, v in zip(before, variables):
      v.assign(b)
  return [tf.identity(c) for c in change]


def _step(opt, model, form):
  """(x, y, mask) -> flat pre-noise clipped sum, through the custom-loop `form`, in a tf.function."""
  given = model if form.endswith("_model") else None
  run = _minimize if form.startswith("minimize") else _grads

  @tf.function
  def step(x, y, mask):
    return tf.concat([tf.reshape(g, [-1]) for g in run(opt, model, form, given, x, y, mask)], 0)

  return lambda x, y, mask: np.asarray(step(x, y, mask), np.float64)


def _reference(model, x, y, mask):
  """Sum of per-example clipped gradients, one example at a time (eager, no vectorization)."""
  total = 0.0
  for i in range(len(x)):
    if mask[i] == 0:
      continue
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(_losses(model, x[i:i + 1], y[i:i + 1]))
    g = np.concatenate([np.asarray(t, np.float64).ravel()
                        for t in tape.gradient(loss, model.trainable_variables)])
    total = total + g * min(1.0, CLIP / max(np.linalg.norm(g), 1e-30))
  return total


_REFERENCES = {}


def _reference_of(kind, seed, model, x, y, mask):
  """`_reference` of (kind, seed), computed once per process: every form's model is
  `_model(kind)` (seeded, so the same weights, checked here) and the batch is the seed's."""
  weights = [np.asarray(w) for w in model.trainable_variables]
  key = (kind, seed)
  if key in _REFERENCES:
    cached_weights, ref = _REFERENCES[key]
    if len(cached_weights) == len(weights) and all(
        np.array_equal(a, b) for a, b in zip(cached_weights, weights)):
      return ref
  ref = _reference(model, x, y, mask)
  _REFERENCES[key] = (weights, ref)
  return ref


def run_form(kind, form, seeds=(0, 1)):
  """Worst move / recorded sensitivity and deviation from the reference, or the refusal."""
  model = _model(kind)
  opt = _optimizer(form)
  private_sum = _step(opt, model, form)
  worst_move, worst_dev = 0.0, 0.0
  try:
    for seed in seeds:
      rng = np.random.RandomState(seed)
      x = np.concatenate([rng.randn(B, *SHAPE), np.zeros((1,) + SHAPE)]).astype("float32")
      y = rng.randint(0, 3, B + 1).astype("int32")
      mask = np.r_[np.ones(B), 0.0].astype("float32")
      base = private_sum(x, y, mask)
      worst_dev = max(worst_dev, float(np.max(np.abs(
          base - _reference_of(kind, seed, model, x, y, mask)))))
      for j in range(B):                      # remove example j
        m2 = mask.copy()
        m2[j] = 0.0
        worst_move = max(worst_move, float(np.linalg.norm(private_sum(x, y, m2) - base)))
      for scale in (0.1, 10.0, 1e3):          # add an adversarial example
        x2 = x.copy()
        x2[B] = rng.randn(*SHAPE) * scale
        worst_move = max(worst_move, float(np.linalg.norm(
            private_sum(x2, y, np.ones(B + 1, "float32")) - base)))
  except ValueError as e:
    return {"refused": str(e)}
  recorded = max(q["sensitivity"] for q in opt.ledger.to_dict()["runs"][-1]["queries"])
  return {"move_over_sensitivity": worst_move / recorded, "recorded": recorded,
          "max_deviation_from_reference": worst_dev, "records": B}


def _paths_onednn():
  """paths_worker.onednn()'s result in this process (test_neighbouring_paths' oneDNN check:
  the vectorized path's routing and sum on MultiHeadAttention + EinsumDense), so that the
  default suite starts one oneDNN process for both files."""
  spec = importlib.util.spec_from_file_location(
      "paths_worker_in_onednn_loop_worker",
      os.path.join(os.path.dirname(os.path.abspath(__file__)), "paths_worker.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.onednn()


def results(cases):
  """{"onednn": whether this process runs oneDNN, "MODEL:FORM": run_form's result} for each
  case of `cases` (default: every form on "einsum"); the case "paths:onednn" is
  paths_worker.onednn()'s result."""
  out = {"onednn": routing.onednn_enabled()}
  for case in cases or ["einsum:" + f for f in FORMS]:
    if case == "paths:onednn":
      out[case] = _paths_onednn()
      continue
    kind, form = case.split(":")
    # minimize runs the vector / tape path of compute_private_gradients: one seed suffices
    out[case] = run_form(kind, form, (0,) if form.startswith("minimize") else (0, 1))
  return out


def main(cases):
  print("RESULT " + json.dumps(results(cases)))


if __name__ == "__main__":
  main(sys.argv[1:])
