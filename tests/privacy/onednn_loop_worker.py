"""Runs every custom-loop form of compute_private_gradients on an EinsumDense model with noise
0 (the output is the pre-noise clipped sum) and prints one line "RESULT {json}": per form,
the largest change of the clipped sum when one example is removed or an adversarial one is
added, in units of the recorded sensitivity, and the largest deviation from a per-example
reference sum; or "refused" with the message (test_custom_loop_onednn runs it with
TF_ENABLE_ONEDNN_OPTS=1 in a subprocess, so a crash is a failing exit code, not a dead test).

usage: onednn_loop_worker.py [FORM ...]
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dpiter as dp  # noqa: E402
from tf_dpiter.keras.optimizer import routing  # noqa: E402

CLIP, B = 0.05, 6
FORMS = ("data", "data_model", "vector", "vector_model", "tape", "tape_model")


SHAPE = (5, 8)


def _model():
  """MultiHeadAttention and a 3-D EinsumDense (the layers oneDNN breaks under vectorization)."""
  keras.utils.set_random_seed(0)
  inp = keras.Input(SHAPE)
  h = keras.layers.MultiHeadAttention(2, 4, name="mha")(inp, inp)
  h = keras.layers.EinsumDense("btd,dk->btk", output_shape=(5, 3), name="einsum")(h)
  return keras.Model(inp, keras.layers.Dense(3)(keras.layers.Flatten()(h)))


def _losses(model, x, y):
  return keras.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                      from_logits=True)


def _step(opt, model, form):
  """(x, y, mask) -> flat pre-noise clipped sum, through the custom-loop `form`, in a tf.function."""
  given = model if form.endswith("_model") else None
  variables = model.trainable_variables

  @tf.function
  def step(x, y, mask):
    if form.startswith("data"):
      grads = opt.compute_private_gradients(lambda d: _losses(model, d[0], d[1]), variables,
                                            data=(x, y), mask=mask, model=given)
    elif form.startswith("vector"):
      grads = opt.compute_private_gradients(lambda: _losses(model, x, y), variables,
                                            mask=mask, model=given)
    else:
      with tf.GradientTape(persistent=True) as tape:
        losses = _losses(model, x, y)
      grads = opt.compute_private_gradients(losses, variables, mask=mask, tape=tape,
                                            model=given)
    return tf.concat([tf.reshape(g, [-1]) for g in grads], 0)

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


def run_form(form, seeds=(0, 1)):
  model = _model()
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, normalize=False)
  opt.set_sampling(1000, B / 1000, "poisson")
  private_sum = _step(opt, model, form)
  worst_move, worst_dev = 0.0, 0.0
  try:
    for seed in seeds:
      rng = np.random.RandomState(seed)
      x = np.concatenate([rng.randn(B, *SHAPE), np.zeros((1,) + SHAPE)]).astype("float32")
      y = rng.randint(0, 3, B + 1).astype("int32")
      mask = np.r_[np.ones(B), 0.0].astype("float32")
      base = private_sum(x, y, mask)
      worst_dev = max(worst_dev, float(np.max(np.abs(base - _reference(model, x, y, mask)))))
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
          "max_deviation_from_reference": worst_dev}


def main(forms):
  out = {"onednn": routing.onednn_enabled()}
  for form in forms or FORMS:
    out[form] = run_form(form)
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1:])
