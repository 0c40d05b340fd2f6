"""Poisson sampling inside the tf.data graph: no Python generator in the input pipeline.

`poisson_batches_in_graph` yields the batches of `poisson_batches` (same law, padding and
SamplingSpec) drawn and gathered by TensorFlow ops in tf.data's C++ threads (no GIL
contention with Keras' loop): the c-th sample the dataset ever draws compares n float64
uniforms of TF's stateless Philox (seed (k0, k1 xor c), k0 and k1 63 bits of OS entropy
each) with q; the e-th iterator of the dataset draws c = e T .. e T + T - 1 (T steps).

Law: record i joins a sample iff u_{c,i} < q, u uniform on a float64 grid of 2^-52 spacing:
P = q up to 2^-52. e counts the iterators over the dataset's whole life (a variable of the
dataset: every epoch, `repeat` and later `fit` on it continues it, never restarts it), so
the samples of different steps and records are distinct outputs of the Philox stream and
independent (McMahan et al. 2018, Section 8), as the ledger's Poisson events assume. The
arrays are held in memory as tf constants.
"""

import secrets

import numpy as np
import tensorflow as tf

from tf_dpiter.data import sampling as sampling_lib


def poisson_batches_in_graph(x, y, expected_batch_size=256, steps_per_epoch=None,
                             max_batch_size="auto", seed=None):
  """tf.data.Dataset of Poisson samples (x_pad, y_pad, weights) of arrays x, y (n records on
  the leading axis; y may be None), drawn in the graph, with the element structure and
  SamplingSpec of `poisson_batches` (expected_batch_size, steps_per_epoch, max_batch_size
  as there). seed: tests only (reproducible, NOT private; warns); None: 126 bits of OS
  entropy.

  Raises:
    ParameterValueError: an argument out of range, or x and y of different lengths.
  """
  n = sampling_lib.num_records(tuple(a for a in (x, y) if a is not None))
  q, steps = sampling_lib.check_poisson_args(n, expected_batch_size, steps_per_epoch,
                                            max_batch_size)
  pad = sampling_lib.default_max_batch_size(n, q) if max_batch_size == "auto" else max_batch_size
  if seed is None:
    key = [secrets.randbits(63), secrets.randbits(63)]
  else:
    rng = sampling_lib.make_rng(seed, who="poisson_batches_in_graph")
    key = [int(k) for k in rng.integers(0, 2**63 - 1, size=2)]
  tensors = [tf.constant(np.asarray(a)) for a in (x, y) if a is not None]
  key0, key1 = tf.constant(key[0], tf.int64), tf.constant(key[1], tf.int64)
  # iterators started so far (each epoch, `repeat`, later fits): iterator e draws the samples
  # c = e * steps + t, t = 0 .. steps - 1, instead of replaying c = t
  started = tf.Variable(0, dtype=tf.int64, trainable=False, name="poisson_iterators_started")

  def steps_of_an_iterator(_):
    first = (started.assign_add(1) - 1) * steps
    return tf.data.Dataset.range(first, first + steps)

  def draw(c):
    u = tf.random.stateless_uniform([n], seed=tf.stack([key0, tf.bitwise.bitwise_xor(key1, c)]), dtype=tf.float64)
    idx = tf.where(u < q)[:, 0]
    m = tf.shape(idx)[0]
    size = m if pad is None else pad * tf.maximum(1, (m + pad - 1) // pad)
    out = []
    for a in tensors:
      rows = tf.gather(a, idx)
      out.append(tf.pad(rows, [[0, size - m]] + [[0, 0]] * (len(a.shape) - 1)))
    mask = tf.pad(tf.ones([m], tf.float32), [[0, size - m]])
    return tuple(out) + (mask,)

  ds = tf.data.Dataset.range(1).flat_map(steps_of_an_iterator).map(
      draw, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  ds = ds.apply(tf.data.experimental.assert_cardinality(steps)).prefetch(2)
  ds = ds.with_options(sampling_lib.PIPELINE_OPTIONS)
  return sampling_lib.attach_spec(ds, sampling_lib.SamplingSpec(
      sampling_lib.POISSON, n, q, float(expected_batch_size)))
