"""The Gaussian query's full draws are calls of one function TensorFlow does not inline
(`gaussian_query._noised_stream`): its exact-tail branch and loops stay once in the graph
Grappler optimizes and the executor runs, however many draws the sum needs (BERT-base's 26
draws, inlined, were about 9,000 of its first step's graph nodes)."""

import numpy as np
import tensorflow as tf

from tf_dpiter.dp_query import gaussian_query


def test_full_draws_call_one_function_marked_noinline(monkeypatch):
  """Five full draws of 1,000 values and a partial one: the traced graph calls one
  function five times, and that function carries `_noinline` (so the runtime keeps it a
  call); every value of the 5,500 is noised once (no two equal)."""
  monkeypatch.setattr(gaussian_query, "BLOCK_VALUES", 1000)
  gen = tf.random.Generator.from_seed(5, alg="philox")
  leaves = [tf.zeros([50, 100]), tf.zeros([500])]
  fn = tf.function(lambda: gaussian_query.add_gaussian_noise(gen, leaves, 1.0))
  graph = fn.get_concrete_function().graph
  calls = [op for op in graph.get_operations()
           if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
  assert len(calls) == 5
  assert len({op.get_attr("f").name for op in calls}) == 1
  library = {f.signature.name: f for f in graph.as_graph_def().library.function}
  draw = library[calls[0].get_attr("f").name]
  assert draw.attr["_noinline"].b
  # (inside an XLA program too: test_noise_in_place.py's "xla" mode draws full blocks)
  z = np.concatenate([t.numpy().ravel() for t in fn()])
  assert z.size == 5500 and np.all(z != 0.0)
  assert len(np.unique(z)) == z.size


def test_grappler_optimizes_this_module_in_every_tier():
  """This module's claim is about the graph Grappler optimizes: tests/conftest.py keeps
  Grappler on for it (KEEP_GRAPPLER) also in the default tier's cheaper compile settings."""
  assert not tf.config.optimizer.get_experimental_options().get("disable_meta_optimizer",
                                                                False)
