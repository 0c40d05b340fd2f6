"""The DP-SGD noise drawn inside the XLA-compiled step: a stateless, counter-based draw.

The Gaussian mechanism of DP-SGD (Abadi et al., "Deep Learning with Differential Privacy",
2016; McMahan et al., "A General Approach to Adding Differential Privacy to Iterative
Training Procedures", Section 7) adds N(0, sigma^2) with sigma = z S to every coordinate of
the clipped sum, once per logical batch. Under `jit_compile=True` the draw runs in the same
XLA program as the clipped sum: `tf.random.stateless_normal` (Philox) keyed by
(key, counter), where

* the key is 64 bits from `os.urandom`, drawn when the step first needs it. It is held in a
  variable that is NOT tracked by the optimizer, so it is never written to a checkpoint, a
  saved model or a config: whoever knows the key can regenerate every noise vector and
  subtract it from the released updates, which removes the privacy. A restored model
  draws a fresh key, so its noise is independent of the run before the save. With `seed`
  (tests only, not private) the key is derived from the seed.
* the counter is the optimizer's `iterations` (an optimizer variable, checkpointed, read
  inside the program, never folded into it): it advances by exactly one per step, so no
  (key, counter) pair is used twice.

Only the ledger append stays outside the compiled program (its buffers grow); it is
exact, one sample per step (`private_step.PrivateStep.record_compiled_sample`). By default
the draw is compiled on accelerators only: XLA:CPU generates it single-threaded, slower
than TensorFlow's kernel (`PrivateStep.compiles_noise`).
"""

import os

import numpy as np
import tensorflow as tf

from tf_dpiter import dp_query as dp_query_lib


def make_key(seed=None):
  """A 64-bit Philox key: from os.urandom, or (seed given; tests only) from the seed.

  Args:
    seed: None, or an integer (deterministic noise for tests; not private).
  Returns:
    a Python int in [0, 2^63).
  """
  if seed is None:
    return int.from_bytes(os.urandom(8), "little") >> 1
  return int(np.random.SeedSequence(int(seed)).generate_state(1, np.uint64)[0]) >> 1


def compiles_noise(step):
  """True when the step's noise is drawn inside the XLA program: the default Gaussian query
  only (not a custom dp_query, a correlated mechanism or secure_mode, whose os.urandom draw
  is a host call), by default on an accelerator. On CPU XLA generates the normal draw
  single-threaded, slower than TensorFlow's kernel (measured for the MLP's 407k
  coordinates: 53 ms against 13 ms, one process, benchmarks/xla_step_breakdown.py), so
  there the draw stays right after the program. `step.noise_in_compiled_program` True
  forces it (tests), False refuses it.

  Args:
    step: the PrivateStep.
  Returns:
    bool.
  """
  if step.noise != "iid" or step.custom_query or step.secure_mode:
    return False
  if step.noise_in_compiled_program is not None:
    return bool(step.noise_in_compiled_program)
  return bool(tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))


def step_seed(step):
  """The (key, counter) pair of the step's stateless draw, read outside the program.

  Args:
    step: the PrivateStep (its untracked key variable, its optimizer's iterations).
  Returns:
    an int64 [2] tensor: the key (make_key) and the optimizer's iterations.
  """
  key = step.state.noise_key(step.seed)
  return tf.stack([key.read_value(), tf.cast(step.optimizer.iterations, tf.int64)])


def record_gaussian_sample(query, global_state):
  """Appends to the ledger the sample and the GaussianSumEvent(S, sigma) that the Gaussian
  query's `get_noised_result` records (QueryWithLedger), for a noise drawn elsewhere.

  Args:
    query: the step's QueryWithLedger (its ledger and declared sampling).
    global_state: the Gaussian query's global state (l2_norm_clip, stddev).
  Returns:
    the ledger's sample-count op.
  """
  event = dp_query_lib.GaussianSumEvent(global_state.l2_norm_clip, global_state.stddev)
  return query.ledger.record_sample(
      query.population_size, query.selection_probability, (event,), policy=query.policy,
      sample_size=query.sample_size, examples_per_record=query.examples_per_record)


def noised_sum(sample_state, stddev, seed):
  """sample_state + N(0, stddev^2) per coordinate, from a stateless counter-based draw.

  Leaves of one privacy dtype (float32, or float64 for float64 leaves) share one draw of
  their total size, sliced in order; each dtype draws from its own fold of the seed.

  Args:
    sample_state: a nest of float tensors (the clipped sum).
    stddev: sigma >= 0 in sum units (a Python float: computed once, sigma = z S).
    seed: int64 [2] tensor (key, counter).
  Returns:
    the noised nest, same structure and dtypes.
  """
  leaves = [tf.convert_to_tensor(v) for v in tf.nest.flatten(sample_state)]
  out = list(leaves)
  by_dtype = {}
  for i, v in enumerate(leaves):
    by_dtype.setdefault(tf.float64 if v.dtype == tf.float64 else tf.float32, []).append(i)
  for j, (dtype, idx) in enumerate(sorted(by_dtype.items(), key=lambda kv: kv[0].name)):
    sizes = [leaves[i].shape.num_elements() for i in idx]
    draw_seed = tf.random.experimental.stateless_fold_in(tf.cast(seed, tf.int64), j)
    # alg="philox" explicitly: the same stream on every device, and under XLA:CPU about 12x
    # faster than the default "auto_select" (benchmarks/xla_step_breakdown.py)
    noise = tf.random.stateless_normal([sum(sizes)], seed=draw_seed, dtype=dtype, alg="philox")
    noise = noise * tf.constant(stddev, dtype)
    offset = 0
    for i, size in zip(idx, sizes):
      piece = tf.reshape(noise[offset:offset + size], leaves[i].shape)
      out[i] = tf.cast(tf.cast(leaves[i], dtype) + piece, leaves[i].dtype)
      offset += size
  return tf.nest.pack_sequence_as(sample_state, out)
