"""Averages of the trained weights (EMA and Polyak), evaluated in place of the last iterate.

  EMA:    a_0 = w_0,  a_t = d a_{t-1} + (1 - d) w_t            (exponential moving average)
  Polyak: a_t = (1 / (t - s + 1)) sum_{k = s..t} w_k             (uniform average from step s)

where w_t are the trainable weights after step t. De et al., "Unlocking High-Accuracy
Differentially Private Image Classification through Scale", 2022, Section 3.2 (EMA of the
DP-SGD iterates); Polyak and Juditsky, "Acceleration of Stochastic Approximation by
Averaging", SIAM J. Control Optim. 1992 (the uniform average).

Privacy: every w_t is released by DP-SGD under the ledger's guarantee, and the averages are
functions of the w_t only (post-processing, Dwork and Roth, "The Algorithmic Foundations of
Differential Privacy", Proposition 2.1): averaging costs no privacy and the ledger's
epsilon covers the averaged model.
"""

import keras
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError


class _WeightAveraging(keras.callbacks.Callback):
  """Keeps an average of the model's trainable weights, updated after every training batch
  (every execution with steps_per_execution > 1); validation runs on it, and at the end of
  `fit` it is left in the model (`swap_on_train_end`; `restore_raw()` puts the last iterate
  back). The optimizer's state and the ledger are never touched.
  """

  def __init__(self, swap_on_train_end=True):
    super().__init__()
    self.swap_on_train_end = bool(swap_on_train_end)
    self._avg = None          # tf.Variables, one per trainable weight
    self._raw = None          # the raw weights while the average is swapped in
    self._count = None
    self._update_fn = None
    self._fitting = False     # inside fit (validation runs on the average)

  # -- the average -----------------------------------------------------------------------
  def _weights(self):
    return [w.value if hasattr(w, "value") else w for w in self.model.trainable_weights]

  def _ensure_built(self):   # `_update`: one step of the average, each subclass' rule
    if self._avg is None:
      self._avg = [tf.Variable(tf.convert_to_tensor(w), trainable=False)
                   for w in self._weights()]
      self._count = tf.Variable(0, dtype=tf.int64, trainable=False)
      self._update_fn = tf.function(self._update)

  def on_train_begin(self, logs=None):
    if self._raw is not None:       # a previous fit ended with the average swapped in
      self.restore_raw()
    self._avg = None
    self._ensure_built()

  def on_train_batch_end(self, batch, logs=None):
    self._update_fn()

  @property
  def averaged_weights(self):
    """The current average, as a list of NumPy arrays (the trainable weights' order)."""
    self._ensure_built()
    return [a.numpy() for a in self._avg]

  # -- swapping --------------------------------------------------------------------------
  def swap_in(self):
    """Put the average into the model (keeping the raw weights for `restore_raw`)."""
    if self._avg is None or self._raw is not None:
      return
    self._raw = [tf.identity(tf.convert_to_tensor(w)) for w in self._weights()]
    for var, avg in zip(self.model.trainable_weights, self._avg):
      var.assign(avg)

  def restore_raw(self):
    """Put the raw (last) iterate back into the model."""
    if self._raw is None:
      return
    for var, raw in zip(self.model.trainable_weights, self._raw):
      var.assign(raw)
    self._raw = None

  def on_test_begin(self, logs=None):
    if self._fitting:
      self.swap_in()

  def on_test_end(self, logs=None):
    if self._fitting:
      self.restore_raw()

  def on_train_end(self, logs=None):
    self._fitting = False
    if self.swap_on_train_end:
      self.swap_in()

  def on_epoch_begin(self, epoch, logs=None):
    self._fitting = True


class ExponentialMovingAverage(_WeightAveraging):
  """EMA of the trainable weights: a_t = d a_{t-1} + (1 - d) w_t, a_0 = the initial weights.

  With `warmup=True` the decay at step t is min(d, (1 + t) / (10 + t)) (TensorFlow's
  `ExponentialMovingAverage(num_updates=t)` rule), so the initialization does not dominate.

  Args:
    decay: d in [0, 1).
    warmup: the (1 + t) / (10 + t) cap on the decay.
    swap_on_train_end: leave the average in the model after `fit`.

  Raises:
    ParameterValueError: a decay outside [0, 1).
  """

  def __init__(self, decay=0.999, warmup=False, swap_on_train_end=True):
    super().__init__(swap_on_train_end)
    if not 0.0 <= decay < 1.0:
      raise ParameterValueError(f"`decay` must be in [0, 1). Received: decay={decay!r}")
    self.decay = float(decay)
    self.warmup = bool(warmup)

  def _update(self):
    self._count.assign_add(1)
    d = tf.constant(self.decay, tf.float64)
    if self.warmup:
      t = tf.cast(self._count, tf.float64)
      d = tf.minimum(d, (1.0 + t) / (10.0 + t))
    for avg, w in zip(self._avg, self._weights()):
      dd = tf.cast(d, avg.dtype)
      avg.assign(dd * avg + (1.0 - dd) * tf.cast(w, avg.dtype))


class PolyakAveraging(_WeightAveraging):
  """Uniform (Polyak-Ruppert) average of the iterates from step `start` on.

  a_t = (1 / (t - s + 1)) sum_{k = s..t} w_k for t >= s (s = `start`, in training batches
  from the start of `fit`); before s the average follows the weights.

  Args:
    start: s >= 1, the first step averaged.
    swap_on_train_end: leave the average in the model after `fit`.

  Raises:
    ParameterTypeError: start not an integer.
    ParameterValueError: start < 1.
  """

  def __init__(self, start=1, swap_on_train_end=True):
    super().__init__(swap_on_train_end)
    self.start = validation.check_integer("start", start, 1)

  def _update(self):
    self._count.assign_add(1)
    n = tf.cast(self._count - self.start + 1, tf.float64)
    rate = tf.where(n >= 1.0, 1.0 / tf.maximum(n, 1.0), 1.0)
    for avg, w in zip(self._avg, self._weights()):
      r = tf.cast(rate, avg.dtype)
      avg.assign(avg + r * (tf.cast(w, avg.dtype) - avg))
