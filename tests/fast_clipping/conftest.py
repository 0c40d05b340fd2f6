"""Shared reference for the fast-clipping tests: an independent per-record loop."""

import numpy as np
import pytest
import tensorflow as tf


def per_record_clipped_sum(model, x, y, loss_fn, clip, k=1, mask=None, memo=None):
  """sum_j min(1, C/||g_j||) g_j in float64, g_j the gradient of the mean loss of
  record j's real examples (rows j*k..j*k+k-1), each record run alone. `x` one array or a
  list of them (a model of several inputs).

  `memo`: a dict shared by calls on one model (weights unchanged), x, y and loss_fn (say one
  call for the norms that pick C, one for the sum at C): a record's gradient, keyed by its
  real rows, is computed once.

  Returns (per-variable sums, per-record norms)."""
  variables = model.trainable_variables
  n = int(tf.nest.flatten(x)[0].shape[0])
  mask = np.ones(n) if mask is None else np.asarray(mask, np.float64)
  total = [np.zeros(v.shape, np.float64) for v in variables]
  norms = []
  for j in range(n // k):
    rows = [i for i in range(j * k, j * k + k) if mask[i] > 0]
    if not rows:
      norms.append(0.0)
      continue
    if memo is not None and tuple(rows) in memo:
      grads = memo[tuple(rows)]
    else:
      with tf.GradientTape() as tape:
        xr = tf.nest.map_structure(lambda a, r=rows: tf.gather(a, r), x)
        pred = model(xr, training=True)
        loss = tf.reduce_mean(tf.cast(loss_fn(tf.gather(y, rows), pred), tf.float32))
      grads = [np.zeros(v.shape) if g is None else
               np.asarray(tf.convert_to_tensor(g), np.float64)
               for g, v in zip(tape.gradient(loss, variables), variables)]
      if memo is not None:
        memo[tuple(rows)] = grads
    nrm = np.sqrt(sum(np.sum(g * g) for g in grads))
    norms.append(nrm)
    f = min(1.0, clip / nrm) if nrm > 0 else 1.0
    total = [t + f * g for t, g in zip(total, grads)]
  return total, np.array(norms)


@pytest.fixture
def clip_reference():
  return per_record_clipped_sum
