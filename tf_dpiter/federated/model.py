"""Functional fully connected classifier of Geyer et al. 2017 (Section 4: 784-600-100-10, ReLU, no bias).

The parameters are a plain list of tensors, so the same code evaluates one model
(weights [in, out]) or a stack of M client models (weights [M, in, out]) with batched
matmuls; this is what lets the local SGD of all sampled clients run as one computation.
"""

import math

import numpy as np
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError


class MLP:
  """Fully connected ReLU network given by `layer_sizes` (input, hidden..., classes), with its
  parameters a list of arrays passed to `logits` (module docstring).

  Args:
    layer_sizes: the widths, input first and classes last (at least two positive ints).
    use_bias: whether each layer has a bias vector.

  Raises:
    ParameterValueError: fewer than two widths, or a width < 1.
  """

  def __init__(self, layer_sizes=(784, 600, 100, 10), use_bias=False):
    sizes = tuple(int(s) for s in layer_sizes)
    if len(sizes) < 2 or min(sizes) < 1:
      raise ParameterValueError(f"layer_sizes must hold >= 2 positive ints, got {layer_sizes!r}")
    self.layer_sizes = sizes
    self.use_bias = bool(use_bias)

  @property
  def shapes(self):
    """Shapes of the parameter list, in order (W1, [b1], W2, [b2], ...)."""
    return [s for a, b in zip(self.layer_sizes[:-1], self.layer_sizes[1:])
            for s in ([(a, b), (b,)] if self.use_bias else [(a, b)])]

  @property
  def num_params(self):
    """d, the number of parameters of the model (an int): the length of a flat update."""
    return int(sum(np.prod(s) for s in self.shapes))

  def init_params(self, seed=None):
    """Initial parameters: weights ~ N(0, 1/fan_in) truncated at 2 stddev, biases 0.

    Args:
      seed: seeds numpy's generator (None: fresh entropy).

    Returns:
      a list of float32 numpy arrays, shapes `self.shapes`.
    """
    rng = np.random.default_rng(seed)
    params = []
    for shape in self.shapes:
      if len(shape) == 1:
        params.append(np.zeros(shape, np.float32))
        continue
      w = rng.standard_normal(shape)
      bad = np.abs(w) > 2
      while bad.any():
        w[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(w) > 2
      params.append((w / math.sqrt(shape[0])).astype(np.float32))
    return params

  def logits(self, params, x):
    """The network's logits.

    Args:
      params: the parameter list; arrays may carry leading dims shared with x (a client
        batch).
      x: float [..., b, in].

    Returns:
      float [..., b, classes].
    """
    h = x
    n_layers = len(self.layer_sizes) - 1
    step = 2 if self.use_bias else 1
    for i in range(n_layers):
      h = tf.matmul(h, params[i * step])
      if self.use_bias:
        b = params[i * step + 1]
        h = h + tf.expand_dims(b, -2)
      if i < n_layers - 1:
        h = tf.nn.relu(h)
    return h

  def flatten(self, params, batch_dims=0):
    """Concatenates the parameter list into one vector per leading batch index.

    Args:
      params: the parameter list (each with `batch_dims` leading dims).
      batch_dims: leading dims kept (1 for a stack of clients).

    Returns:
      a tensor [..., d], d = `num_params`.
    """
    params = [tf.convert_to_tensor(p) for p in params]
    lead = tf.shape(params[0])[:batch_dims]
    return tf.concat([tf.reshape(p, tf.concat([lead, [-1]], 0)) for p in params], axis=-1)

  def unflatten(self, vector):
    """Inverse of `flatten` for one model.

    Args:
      vector: a flat tensor [d].

    Returns:
      the list of parameter tensors, shapes `self.shapes`.
    """
    parts = tf.split(vector, [int(np.prod(shape)) for shape in self.shapes])
    return [tf.reshape(p, shape) for p, shape in zip(parts, self.shapes)]


def accuracy(model, params, x, y, batch_size=5000):
  """Fraction of correctly classified examples.

  Args:
    model: the `MLP`.
    params: its parameter list.
    x: float [n, in].
    y: int labels [n].
    batch_size: examples per forward pass (memory bound).

  Returns:
    a float in [0, 1] (0 for n = 0).
  """
  correct = 0
  for s in range(0, len(x), batch_size):
    logits = model.logits(params, tf.convert_to_tensor(x[s:s + batch_size]))
    pred = tf.argmax(logits, axis=-1, output_type=tf.int32)
    correct += int(tf.reduce_sum(tf.cast(tf.equal(pred, y[s:s + batch_size]), tf.int32)))
  return correct / max(len(x), 1)
