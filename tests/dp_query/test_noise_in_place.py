"""The Gaussian query's noise in bounded draws (the leaves form one stream of draws of a block
each; a leaf of at most a block across two draws gets its two parts joined and one addition, a
larger one is noised block by block into the sum's own buffer:
`gaussian_query.add_gaussian_noise`), and the sample
state of a sum formed elsewhere (`DPQuery.sample_state_of_sum`): no zeros template, no copy
of the sum."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter import dp_query
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import normalized_query
from tf_dpiter.dp_query import randomness


@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
def test_blocked_leaf_gets_every_coordinate_noised_once(mode, monkeypatch):
  """With blocks of 1,000 values a leaf of 4,500 (four full blocks and a partial one) and a
  leaf below one block: every value is noised (none left at 0), the law is
  N(0, sigma^2) within 5 standard errors of the standard deviation, no value repeats
  across blocks or leaves, shapes and dtypes are kept, also inside an XLA program."""
  monkeypatch.setattr(gaussian_query, "BLOCK_VALUES", 1000)
  gen = tf.random.Generator.from_seed(21, alg="philox")
  leaves = [tf.zeros([90, 50]), tf.zeros([300]), tf.zeros([40, 25])]
  fn = lambda: gaussian_query.add_gaussian_noise(gen, leaves, 2.0)  # noqa: E731
  if mode != "eager":
    fn = tf.function(fn, jit_compile=mode == "xla")
  out = fn()
  noise = []
  for leaf, noised in zip(leaves, out):
    assert noised.shape == leaf.shape and noised.dtype == leaf.dtype
    z = noised.numpy().ravel()
    assert np.all(z != 0.0)
    noise.append(z)
  z = np.concatenate(noise)
  assert abs(z.std() - 2.0) < 5 * 2.0 * math.sqrt(2.0 / z.size)
  assert abs(z.mean()) < 5 * 2.0 / math.sqrt(z.size)
  assert len(np.unique(z)) > 0.999 * z.size   # a repeated block would repeat 1,000


def test_blocked_leaf_16_bit_and_graph_updates_in_place(monkeypatch):
  """A bfloat16 leaf larger than a block comes back bfloat16 with its noise computed in
  float32; the blocked path writes each block with TensorStridedSliceUpdate (in place when
  nothing else reads the sum) and draws nothing the size of the whole leaf."""
  monkeypatch.setattr(gaussian_query, "BLOCK_VALUES", 1024)
  sizes = []
  real_noise = gaussian_query._noise  # pylint: disable=protected-access

  def counted(generator, size, dtype, stddev):
    sizes.append(size)
    return real_noise(generator, size, dtype, stddev)

  monkeypatch.setattr(gaussian_query, "_noise", counted)
  gen = tf.random.Generator.from_seed(22, alg="philox")
  fn = tf.function(lambda x: gaussian_query.add_gaussian_noise(gen, [x * 1.0], 3.0))
  x = tf.zeros([64, 80], tf.bfloat16)
  (out,) = fn(x)
  assert out.dtype == tf.bfloat16 and out.shape == (64, 80)
  z = tf.cast(out, tf.float64).numpy().ravel()
  assert abs(z.std() - 3.0) < 5 * 3.0 * math.sqrt(2.0 / z.size) + 0.03
  ops = fn.get_concrete_function(x).graph.get_operations()
  assert sum(op.type == "TensorStridedSliceUpdate" for op in ops) == 5   # ceil(5120 / 1024)
  # five full draws: five calls of one traced draw function of 1,024 values
  assert sizes == [1024]
  assert sum(op.type in ("PartitionedCall", "StatefulPartitionedCall") for op in ops) == 5


def test_leaf_across_two_draws_is_joined_and_added_once(monkeypatch):
  """With blocks of 1,024 values, leaves of 700, 700 and 2,600 values: the second (across the
  first two draws) gets its two parts joined (one ConcatV2) and one addition, no strided write;
  only the leaf larger than a block (across three draws) is written block by block. Its values
  are the stream's values 700..1,399, as the eager run (each draw's parts sliced by hand)."""
  monkeypatch.setattr(gaussian_query, "BLOCK_VALUES", 1024)
  leaves = [tf.zeros([700]), tf.zeros([35, 20]), tf.zeros([2600])]
  gen = tf.random.Generator.from_seed(25, alg="philox")
  fn = tf.function(lambda: gaussian_query.add_gaussian_noise(gen, leaves, 1.0), autograph=False)
  graph = fn.get_concrete_function().graph
  ops = [op for op in graph.get_operations() if op.type == "TensorStridedSliceUpdate"]
  assert len(ops) == 3   # the 2,600-value leaf only: parts in draws 2, 3 and 4
  joins = [[t.shape.num_elements() for t in op.inputs[:-1]] for op in graph.get_operations()
           if op.type == "ConcatV2"]
  assert [324, 376] in joins   # the second leaf's parts: the first draw's last 324 values
  assert sum(n == [324, 376] for n in joins) == 1
  out = fn()
  draws = tf.random.Generator.from_seed(25, alg="philox")
  stream = np.concatenate([np.concatenate([h.numpy() for h in randomness.padded_normal_halves(
      draws, n, 1.0)])[:n] for n in (1024, 1024, 1024, 928)])
  np.testing.assert_allclose(out[1].numpy().ravel(), stream[700:1400], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(out[2].numpy().ravel(), stream[1400:4000], rtol=1e-6, atol=1e-6)


def test_sum_aggregation_state_is_the_sum_itself():
  """GaussianSumQuery's (and its ledger wrapper's) state of a sum is the sum's own tensors (no
  zeros, no add); a float32 template turns a float64 sum into float32."""
  query = gaussian_query.GaussianSumQuery(1.0, 0.0)
  template = [tf.TensorSpec([3, 2], tf.float32), tf.TensorSpec([4], tf.float32)]
  total = [tf.ones([3, 2]), tf.range(4, dtype=tf.float32)]
  state = query.sample_state_of_sum(template, total)
  assert state[0] is total[0] and state[1] is total[1]
  cast = query.sample_state_of_sum(template[1:], [tf.ones([4], tf.float64)])
  assert cast[0].dtype == tf.float32


def test_query_with_its_own_state_gets_initial_plus_accumulate():
  """A query whose sample state is not the plain sum (NormalizedQuery) gets
  accumulate_preprocessed_record(initial_sample_state(template), sum): the same state as
  accumulating the sum by hand."""
  query = normalized_query.NormalizedQuery(gaussian_query.GaussianSumQuery(1.0, 0.0), 4.0)
  template = [tf.TensorSpec([2], tf.float32)]
  total = [tf.constant([1.0, -2.0])]
  by_hand = query.accumulate_preprocessed_record(query.initial_sample_state(template), total)
  got = query.sample_state_of_sum(template, total)
  tf.nest.map_structure(lambda a, b: np.testing.assert_array_equal(a.numpy(), b.numpy()),
                        by_hand, got)
  assert isinstance(query, dp_query.DPQuery)


def test_small_leaves_share_bounded_draws(monkeypatch):
  """Ten leaves of 300 values with blocks of 1,000: one stream of 3,000 values in three draws
  of 1,000 (leaves across two draws take a part of each), none larger; a float64 leaf gets its
  own draw; each leaf gets distinct N(0, sigma^2) values."""
  monkeypatch.setattr(gaussian_query, "BLOCK_VALUES", 1000)
  sizes = []
  real_noise = gaussian_query._noise  # pylint: disable=protected-access

  def counted(generator, size, dtype, stddev):
    sizes.append((size, dtype))
    return real_noise(generator, size, dtype, stddev)

  monkeypatch.setattr(gaussian_query, "_noise", counted)
  gen = tf.random.Generator.from_seed(23, alg="philox")
  leaves = [tf.zeros([300]) for _ in range(10)] + [tf.zeros([200], tf.float64)]
  out = gaussian_query.add_gaussian_noise(gen, leaves, 1.5)
  assert sizes == [(1000, tf.float32)] * 3 + [(200, tf.float64)]
  z = np.concatenate([o.numpy().ravel() for o in out[:10]])
  assert len(np.unique(z)) > 0.999 * z.size   # a value used twice would repeat 300
  assert abs(z.std() - 1.5) < 5 * 1.5 * math.sqrt(2.0 / z.size)
  assert out[10].dtype == tf.float64 and np.all(out[10].numpy() != 0.0)


def test_graph_size_does_not_grow_with_the_number_of_draws(monkeypatch):
  """In a traced graph every full draw calls one function: 4 or 16 draws of 1,000 values make
  the same function library (the exact-tail branch and loops once), and the outer graph grows
  by a few ops per draw; every value of the stream is used once."""
  monkeypatch.setattr(gaussian_query, "BLOCK_VALUES", 1000)
  gen = tf.random.Generator.from_seed(24, alg="philox")

  def traced(n_leaves):
    leaves = [tf.zeros([500]) for _ in range(n_leaves)]
    fn = tf.function(lambda: gaussian_query.add_gaussian_noise(gen, leaves, 1.0))
    graph = fn.get_concrete_function().graph.as_graph_def()
    return len(graph.library.function), len(graph.node), fn()

  lib4, nodes4, _ = traced(8)      # 4 draws
  lib16, nodes16, out = traced(32)  # 16 draws
  assert lib4 == lib16
  assert nodes16 - nodes4 < 12 * 40   # a call, its slices and additions per draw
  z = np.concatenate([o.numpy() for o in out])
  assert len(np.unique(z)) > 0.999 * z.size
