"""Tree aggregation: one leaf is the Gaussian sum; the prefix sums carry the tree's noise."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import tree_aggregation_query as taq


def _noise(query, template, steps):
  zeros = tf.nest.map_structure(tf.zeros_like, template)
  state = query.initial_global_state()
  out = []
  for _ in range(steps):
    sample = query.initial_sample_state(template)
    sample = query.accumulate_preprocessed_record(sample, zeros)
    result, state, events = query.get_noised_result(sample, state)
    out.append(np.concatenate([np.ravel(v.numpy()) for v in tf.nest.flatten(result)]))
  return np.stack(out), events


@pytest.mark.parametrize("seed", [0, 5])
def test_tree_of_one_leaf_adds_exactly_the_gaussian_sum_noise(seed):
  template = [tf.zeros([4, 3]), tf.zeros([7])]
  tree = taq.TreeAggregationQuery(2.0, 0.8, template, restart_every=1, seed=seed)
  gauss = gaussian_query.GaussianSumQuery(2.0, 0.8 * 2.0, seed=seed)
  got, events = _noise(tree, template, 5)
  want, _ = _noise(gauss, template, 5)
  # Same Philox values, same coordinates; the Gaussian query multiplies sigma into the
  # Box-Muller radius (r sigma cos) where this query scales z (r cos sigma): the float32
  # products may differ in their last bits, a few ulp of the largest value.
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=4 * np.finfo(np.float32).eps * np.abs(want).max())
  assert tree.depth == 1 and events[0].tree_size == 1


def _nodes(step, restart):
  """Node ids in the noise of the prefix sum after `step` steps: frozen trees + current one."""
  ids = set()
  for t in range(step):
    tree, leaf = divmod(t, restart)
    leaf += 1
    if leaf == restart or t == step - 1:
      ids |= {(tree, j, leaf >> j) for j in range(leaf.bit_length()) if (leaf >> j) & 1}
  return ids


@pytest.mark.parametrize("restart", [8, 5])
def test_prefix_sum_noise_has_the_tree_covariance(restart):
  steps, d, z, clip = 11, 20000, 1.3, 1.0
  query = taq.TreeAggregationQuery(clip, z, [tf.zeros([d])], restart_every=restart, seed=4)
  sigma = z * clip * np.sqrt(query.depth)
  prefix = np.cumsum(_noise(query, [tf.zeros([d])], steps)[0], axis=0)
  ids = [_nodes(t + 1, restart) for t in range(steps)]
  expected = sigma ** 2 * np.array([[len(a & b) for b in ids] for a in ids], float)
  got = prefix @ prefix.T / d
  se = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected ** 2) / d)
  assert np.all(np.abs(got - expected) <= 5 * se), np.max(np.abs(got - expected) / se)


def test_tree_prefix_error_matches_the_node_count():
  # Restart every 4: leaves 1..4 have 1, 1, 2, 1 nodes; the second tree adds the frozen 1.
  depth = 3
  assert taq.tree_prefix_error(4, 4) == pytest.approx(depth * 5 / 4)
  assert taq.tree_prefix_error(8, 4) == pytest.approx(depth * (5 + 4 * 1 + 5) / 8)
  assert taq.tree_prefix_error(6, 1) == pytest.approx((1 + 2 + 3 + 4 + 5 + 6) / 6)


def test_bad_restart_is_refused():
  with pytest.raises(ValueError, match="restart_every"):
    taq.TreeAggregationQuery(1.0, 1.0, [tf.zeros([2])], restart_every=0)
