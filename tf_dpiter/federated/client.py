"""ClientUpdate of Geyer et al. 2017 (Algorithm 1, lines 10-18), vectorized over the clients of a round.

Each client k runs E epochs of minibatch SGD (batch B, rate eta, mean softmax cross-entropy)
from w_t on its own examples and returns Delta w_k = w_k - w_t. All M clients train in one
traced computation, their models stacked on a leading client axis (client k's loss depends
only on its slice, so the summed loss's gradient is the stack of theirs); each client's
example order is a permutation of its examples then masked padding, whose rows are zeroed
(a client's update reads only its own examples).
"""

import numpy as np
import tensorflow as tf

from tf_dpiter import validation

from tf_dpiter.errors import ParameterValueError


def draw_example_order(generator, client_sizes, n_max, epochs):
  """Per-client shuffles of the local examples for every epoch of ClientUpdate.

  Args:
    generator: a tf.random.Generator (the simulation's; seeded only in tests).
    client_sizes: int [M], the number of examples of each client.
    n_max: the padded length of a client's index row (>= max client size).
    epochs: E, local epochs.

  Returns:
    int32 [M, E, n_max]: row (k, e) is a permutation of positions with the client's valid
    positions (< client_sizes[k]) first; the rest is padding, never read by training.
  """
  sizes = tf.convert_to_tensor(client_sizes, tf.int32)
  m = tf.shape(sizes)[0]
  keys = generator.uniform(tf.stack([m, epochs, n_max]), dtype=tf.float32)
  pos = tf.range(n_max)[None, None, :]
  keys = tf.where(pos < sizes[:, None, None], keys, 2.0)
  return tf.argsort(keys, axis=-1, stable=True, direction="ASCENDING")


class LocalSGD:
  """Vectorized ClientUpdate: E epochs of minibatch SGD for a stack of clients.

  Args:
    model: an `MLP` (functional model: `logits(params, x)` with leading batch dims).
    epochs: E, local epochs per round.
    batch_size: B, examples per local minibatch (the last batch of an epoch may be smaller).
    learning_rate: eta, client SGD step size.
    jit_compile: compile the local training with XLA.
  """

  def __init__(self, model, epochs=1, batch_size=60, learning_rate=0.1, jit_compile=False):
    self.model = model
    self.epochs = validation.check_integer("epochs", epochs, 1)
    self.batch_size = validation.check_integer("batch_size", batch_size, 1)
    self.learning_rate = float(validation.check_positive("learning_rate", learning_rate))
    self._fn = tf.function(self._train, reduce_retracing=True, jit_compile=jit_compile)

  def _train(self, params, x_all, y_all, client_indices, client_sizes, order):
    m = tf.shape(client_indices)[0]
    n_max = tf.shape(client_indices)[1]
    b = self.batch_size
    steps_per_epoch = (n_max + b - 1) // b
    # Global example index of every (client, epoch, position): [M, E, n_max].
    examples = tf.gather(client_indices, order, batch_dims=1)
    w0 = [tf.convert_to_tensor(p) for p in params]
    stacked = [tf.broadcast_to(p, tf.concat([[m], tf.shape(p)], 0)) for p in w0]
    sizes = client_sizes[:, None]

    def step(t, ws):
      e = t // steps_per_epoch
      start = (t % steps_per_epoch) * b
      idx = examples[:, e, start:start + b]                     # [M, b']
      pos = start + tf.range(tf.shape(idx)[1])[None, :]
      mask = tf.cast(pos < sizes, tf.float32)                    # [M, b']
      # A padded position holds another client's example (data.py pads with example 0):
      # zeroed here, or a non-finite one would make this client's update NaN through the
      # masked loss (0 * NaN), so its update would depend on another client's data.
      bx = tf.gather(x_all, idx)                                 # [M, b', ...]
      by = tf.where(mask > 0, tf.gather(y_all, idx), 0)
      bx = tf.reshape(bx, tf.concat([tf.shape(idx), [-1]], 0))
      bx = tf.where(mask[:, :, None] > 0, bx, 0.0)
      with tf.GradientTape() as tape:
        tape.watch(ws)
        logits = self.model.logits(ws, bx)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=by, logits=logits)
        per_client = tf.reduce_sum(ce * mask, 1) / tf.maximum(tf.reduce_sum(mask, 1), 1.0)
        total = tf.reduce_sum(per_client)
      grads = tape.gradient(total, ws)
      return t + 1, [w - self.learning_rate * g for w, g in zip(ws, grads)]

    total_steps = self.epochs * steps_per_epoch
    _, final = tf.while_loop(lambda t, ws: t < total_steps, step, (tf.constant(0), stacked))
    return [w - p[None] for w, p in zip(final, w0)]

  def __call__(self, params, x_all, y_all, client_indices, client_sizes, order):
    """Returns the stacked updates Delta w_k = w_k - w_t (list of [M, ...] tensors).

    params: list of the server model's tensors w_t. x_all/y_all: the shared examples.
    client_indices: int32 [M, n_max] example indices of the round's clients;
    client_sizes: int32 [M]; order: int32 [M, E, n_max] from `draw_example_order`.
    """
    order = tf.convert_to_tensor(order, tf.int32)
    if order.shape.rank != 3 or (order.shape[1] is not None and order.shape[1] != self.epochs):
      raise ParameterValueError(f"order must be [M, {self.epochs}, n_max], got shape {order.shape}")
    return self._fn([tf.convert_to_tensor(p, tf.float32) for p in params],
                    tf.convert_to_tensor(x_all, tf.float32),
                    tf.convert_to_tensor(y_all, tf.int32),
                    tf.convert_to_tensor(client_indices, tf.int32),
                    tf.convert_to_tensor(client_sizes, tf.int32), order)


def local_sgd_one_client(model, params, x, y, order, batch_size, learning_rate):
  """Reference ClientUpdate for ONE client, eager and unbatched (for tests).

  Args:
    model: the `MLP`.
    params: w_t, a list of arrays.
    x: the client's own examples.
    y: the client's own examples.
    order: int [E, n] with the client's shuffles (the first len(x) entries of each row used).
    batch_size: B.
    learning_rate: eta.

  Returns:
    the update Delta w_k = w_k - w_t, a list of float32 tensors.
  """
  w = [tf.Variable(tf.convert_to_tensor(p, tf.float32)) for p in params]
  n = len(x)
  order = np.asarray(order)
  for e in range(order.shape[0]):
    perm = order[e, :n]
    for s in range(0, n, batch_size):
      ids = perm[s:s + batch_size]
      with tf.GradientTape() as tape:
        logits = model.logits(w, tf.convert_to_tensor(x[ids]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.convert_to_tensor(y[ids]), logits=logits))
      grads = tape.gradient(loss, w)
      for v, g in zip(w, grads):
        v.assign_sub(learning_rate * g)
  return [v - tf.convert_to_tensor(p, tf.float32) for v, p in zip(w, params)]
