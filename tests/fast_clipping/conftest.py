"""Shared reference for the fast-clipping tests: an independent per-record loop."""

import weakref

import numpy as np
import pytest
import tensorflow as tf


_RECORD_GRADIENTS = weakref.WeakKeyDictionary()   # model -> {loss_fn: tf.function}


def _record_gradient(model, loss_fn):
  """The gradient of the mean loss of one record's rows, a tf.function per model and loss
  (traced once per row count and set of trainable variables, its `key`; the model held
  weakly, so that the cache dies with it)."""
  fns = _RECORD_GRADIENTS.setdefault(model, {})
  if loss_fn not in fns:
    ref = weakref.ref(model)

    @tf.function
    def grad(xr, yr, key):  # pylint: disable=unused-argument
      m = ref()
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.cast(loss_fn(yr, m(xr, training=True)), tf.float32))
      return tape.gradient(loss, m.trainable_variables)

    fns[loss_fn] = grad
  return fns[loss_fn]


def per_record_clipped_sum(model, x, y, loss_fn, clip, k=1, mask=None, memo=None,
                           traced=False):
  """sum_j min(1, C/||g_j||) g_j in float64, g_j the gradient of the mean loss of
  record j's real examples (rows j*k..j*k+k-1), each record run alone through the model
  under its own tf.GradientTape (no fast-clipping code). `x` one array or a list of them (a
  model of several inputs).

  `traced`: each record's gradient in a tf.function traced once per model, loss and row
  count (_record_gradient) instead of an eager Keras call: cheaper only for a large model
  over many records (the tutorial CNN's 61 records: 1.3 - 1.9 CPU s less a test); on the
  small models of most tests the traces cost more than the eager calls.

  `memo`: a dict shared by calls on one model (weights unchanged), x, y and loss_fn (say one
  call for the norms that pick C, one for the sum at C): a record's gradient, keyed by its
  real rows, is computed once.

  Returns (per-variable sums, per-record norms)."""
  variables = model.trainable_variables
  key = tuple(id(v) for v in variables)   # traced: a retrace when the trainable set changes
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
      xr = tf.nest.map_structure(lambda a, r=rows: tf.gather(a, r), x)
      if traced:
        raw = _record_gradient(model, loss_fn)(xr, tf.gather(y, rows), key)
      else:
        with tf.GradientTape() as tape:
          loss = tf.reduce_mean(tf.cast(loss_fn(tf.gather(y, rows), model(xr, training=True)),
                                        tf.float32))
        raw = tape.gradient(loss, variables)
      grads = [np.zeros(v.shape) if g is None else
               np.asarray(tf.convert_to_tensor(g), np.float64) for g, v in zip(raw, variables)]
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
