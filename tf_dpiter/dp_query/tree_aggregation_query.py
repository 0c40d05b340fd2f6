"""Online tree aggregation for prefix sums (Kairouz et al., "Practical and Private (Deep)
Learning without Sampling or Shuffling", Section 3, DP-FTRL).

The prefix sum of t clipped sums gets N_t, the sum of the N(0, sigma^2 I) noises of the
dyadic nodes of t; one participation touches depth = ceil(log2(R + 1)) nodes of a tree of R
leaves: one Gaussian of multiplier sigma / (S sqrt(depth)). Step t releases the residual
g_t + N_t - N_{t-1} = g_t + sigma (z_new - sum_{levels i < j} z_i) (j: t's lowest set bit),
from one noise vector per level. The tree restarts every `restart_every` steps (the
accounting assumes each tree lies in one pass).
"""

import collections
import math

import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import band_mf_query
from tf_dpiter.dp_query import correlated_events
from tf_dpiter.dp_query import randomness
from tf_dpiter.dp_query import serialization


def tree_prefix_error(num_steps, restart_every):
  """Mean squared prefix-sum error per step and coordinate, per unit noise multiplier, of the
  tree (a float) over `num_steps` steps, R = `restart_every` leaves per tree:
  mean_t depth x popcount(t within its tree) plus the errors frozen at restarts.

  Raises:
    ParameterValueError: restart_every not an integer >= 1.
  """
  depth = correlated_events.tree_depth(restart_every)
  total, frozen = 0.0, 0.0
  for t in range(num_steps):
    leaf = t % restart_every + 1
    total += frozen + bin(leaf).count("1")
    if leaf == restart_every:
      frozen += bin(leaf).count("1")
  return depth * total / num_steps


@serialization.register_query()
class TreeAggregationQuery(band_mf_query.CorrelatedNoiseQuery):
  """Sum of records clipped to S plus the tree-aggregation residual noise N_t - N_{t-1}."""

  _GlobalState = collections.namedtuple(
      "_GlobalState", ["l2_norm_clip", "stddev", "step", "nodes"])

  def __init__(self, l2_norm_clip, noise_multiplier, template, restart_every, seed=None):
    """Args:
      l2_norm_clip: S per record.
      noise_multiplier: z = sigma / (S sqrt(depth)): the node noise sigma grows with the depth
        so that z is the multiplier of the whole tree (one participation).
      template: a record's structure (tensors, variables, TensorSpecs or shape lists).
      restart_every: R, leaves per tree (the accounting charges one tree per shuffled pass:
        R must divide the steps per pass).
      seed: tests only (not private).

    Raises:
      ParameterTypeError: restart_every not an integer.
      ParameterValueError: a bad argument, named with its value.
    """
    self._init_common(l2_norm_clip, noise_multiplier, template, seed)
    self._restart_every = validation.check_integer("restart_every", restart_every, 1)
    self._depth = correlated_events.tree_depth(self._restart_every)

  def get_config(self):
    return self._config(restart_every=self._restart_every)

  @property
  def depth(self):
    """ceil(log2(R + 1)): the nodes one leaf touches (sigma = z S sqrt(depth))."""
    return self._depth

  @property
  def restart_every(self):
    """R, the leaves of each tree; tree k covers steps [k R, (k + 1) R)."""
    return self._restart_every

  def initial_global_state(self):
    """(S, sigma = z S sqrt(depth), step 0, one zero node per level [depth, d]).

    Returns:
      the query's _GlobalState.
    """
    return self._initial_state(math.sqrt(self._depth),
                               tf.zeros([self._depth, self._size], tf.float32))

  def get_noised_result(self, sample_state, global_state):
    """The sum plus the residual N_t - N_{t-1} of the tree's prefix noise (module doc).

    Args:
      sample_state: the clipped sum (a nest shaped like the template).
      global_state: the query's global state.

    Returns:
      (noised sum, next global state, (TreeGaussianEvent,)).
    """
    leaf = global_state.step % self._restart_every + 1          # 1-based, within its tree
    shifts = tf.range(self._depth, dtype=tf.int64)
    now = tf.bitwise.bitwise_and(tf.bitwise.right_shift(leaf, shifts), 1) > 0
    before = tf.bitwise.bitwise_and(tf.bitwise.right_shift(leaf - 1, shifts), 1) > 0
    opened = now & ~before                                       # exactly one level
    closed = before & ~now
    z = randomness.normal(self._generator, [self._size], tf.float32)
    nodes = global_state.nodes
    if self._depth > 1:
      closed_f = tf.cast(closed, tf.float32)[:, tf.newaxis]
      residual = z - tf.reduce_sum(nodes * closed_f, axis=0)
    else:
      residual = z
    new_nodes = tf.where(opened[:, tf.newaxis], z[tf.newaxis],
                         tf.where(closed[:, tf.newaxis], tf.zeros_like(nodes), nodes))
    result = band_mf_query.add_flat_noise(sample_state, residual * global_state.stddev)
    new_state = self._GlobalState(global_state.l2_norm_clip, global_state.stddev,
                                  global_state.step + 1, new_nodes)
    event = correlated_events.TreeGaussianEvent(global_state.l2_norm_clip, global_state.stddev,
                                                self._restart_every)
    return result, new_state, (event,)
