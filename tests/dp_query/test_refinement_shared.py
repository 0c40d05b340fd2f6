"""The exact-tail refinement of the noise (`randomness._refined`, the branch taken when a
bucket is below refine_below) is, in a graph, a call of one function shared by every trace of
the process and marked `_noinline` (`randomness._shared_refined`): traced once, one call op
in each step graph instead of its two loops. It draws the same words in the same order as
the branch built in place (eagerly), so the noise is bit for bit the same."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import randomness


@pytest.mark.parametrize("size, bucket_bits, refine_below", [(3000, 4, 3), (500, 8, 16),
                                                             (50, 2, 2), (700, 32, 256)])
def test_graph_draw_equals_the_eager_draw_bit_for_bit(size, bucket_bits, refine_below):
  """Small buckets (b = 2..8 bits) make most draws take the refinement, and its memoryless
  restarts (k = 0): the graph's shared function gives the eager branch's values and leaves
  the generator in the same state."""
  def draw(gen):
    return randomness.exponential(gen, size, bucket_bits, refine_below)

  eager_gen = tf.random.Generator.from_seed(11, alg="philox")
  graph_gen = tf.random.Generator.from_seed(11, alg="philox")
  fn = tf.function(lambda: draw(graph_gen))
  eager = np.concatenate([draw(eager_gen).numpy(), draw(eager_gen).numpy()])
  graph = np.concatenate([fn().numpy(), fn().numpy()])
  assert eager.dtype == np.float32 and eager.shape == (2 * size,)
  np.testing.assert_array_equal(graph.view(np.uint32), eager.view(np.uint32))
  np.testing.assert_array_equal(graph_gen.state.numpy(), eager_gen.state.numpy())


def test_two_traces_share_one_noinline_refinement():
  """Two step-like functions on two generators: each graph's branch is a call (a few
  nodes, no loop) of the same function, which carries `_noinline` and was traced once."""
  graphs = []
  for seed in (1, 2):
    gen = tf.random.Generator.from_seed(seed, alg="philox")
    fn = tf.function(lambda g=gen: randomness.padded_normal(g, 4000, 1.5))
    graphs.append(fn.get_concrete_function().graph)
  called = []
  for graph in graphs:
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    conds = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    assert len(conds) == 1
    branches = [library[conds[0].get_attr(b).name] for b in ("then_branch", "else_branch")]
    assert max(len(f.node_def) for f in branches) <= 4
    assert not [n for f in branches for n in f.node_def if "While" in n.op]
    calls = [n for f in branches for n in f.node_def
             if n.op in ("PartitionedCall", "StatefulPartitionedCall")]
    assert len(calls) == 1
    name = calls[0].attr["f"].func.name
    assert library[name].attr["_noinline"].b
    called.append(name)
  assert called[0] == called[1]   # one function: traced once for both graphs
  shared = [fn for key, fn in randomness._SHARED.items() if key[1:] == (32, 256)]  # pylint: disable=protected-access
  assert shared and all(fn.experimental_get_tracing_count() == 1 for fn in shared)
