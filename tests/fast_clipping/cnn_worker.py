"""Subprocess worker for test_tutorial_cnn.py: the tutorial CNN's fast clipped sum against a
per-example loop, under the TF_ENABLE_ONEDNN_OPTS its caller set (read once per process).

Prints `RESULT {json}`: oneDNN on or off, and per examples_per_record k the largest
error of the sums relative to the largest reference entry and the smallest and largest
signed relative deviation of the norms, (norm - reference) / reference (the folded Gram's
norms are upper bounds, so the deviation is one-sided).
"""

import json

import numpy as np
import tensorflow as tf
import keras

from tf_dpiter.keras import example_models
from tf_dpiter.keras.optimizer import routing
from tf_dpiter.keras.fast_clipping import clipping

B = 8
CLIP = 0.5


def loss_fn(y, logits):
  return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)


def loop_reference(model, x, y, k):
  """sum_j min(1, C/||g_j||) g_j, g_j the gradient of record j's mean loss (float64)."""
  variables = model.trainable_variables
  total = [np.zeros(v.shape) for v in variables]
  norms = []
  for j in range(B // k):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(loss_fn(y[j * k:j * k + k], model(x[j * k:j * k + k],
                                                              training=True)))
    grads = [np.asarray(g, np.float64) for g in tape.gradient(loss, variables)]
    n = np.sqrt(sum(np.sum(g * g) for g in grads))
    norms.append(n)
    total = [t + min(1.0, CLIP / n) * g for t, g in zip(total, grads)]
  return total, np.array(norms)


def main():
  keras.utils.set_random_seed(0)
  model = keras.Sequential(example_models.mnist_cnn_layers())
  rng = np.random.default_rng(0)
  x = tf.constant(rng.random((B, 28, 28, 1)), tf.float32)
  y = tf.constant(rng.integers(0, 10, B), tf.int32)
  out = {"onednn": routing.onednn_enabled()}
  step = tf.function(lambda x, y, k: clipping.clipped_grad_sum(
      model, x, y, loss_fn, CLIP, examples_per_record=k), reduce_retracing=True)
  for k in (1, 2):
    ref, ref_norms = loop_reference(model, x, y, k)
    grads, norms = step(x, y, k)
    err = max(float(np.max(np.abs(g.numpy() - r))) / max(float(np.max(np.abs(r))), 1e-30)
              for g, r in zip(grads, ref))
    out[f"k{k}_sum_rel_err"] = err
    dev = (norms.numpy() - ref_norms) / ref_norms
    out[f"k{k}_norm_rel_low"], out[f"k{k}_norm_rel_high"] = float(np.min(dev)), float(np.max(dev))
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  main()
