"""The convolution rule names its norm and sum ops by layer and form (rules/conv.py,
`_scope_name`), and benchmarks/fit_step_split.py attributes a profile's ops to the DP step's
parts by those names: the profile split of issue 42's CNN step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks import fit_step_split
from tf_dpiter.keras import example_models
from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping.rules import conv


def _loss(y, logits):
  return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def _all_node_names(graph):
  """Names of the graph's ops and of the ops in its function library (cond/while bodies)."""
  gdef = graph.as_graph_def()
  names = [n.name for n in gdef.node]
  for f in gdef.library.function:
    names.extend(n.name for n in f.node_def)
  return names


def test_tutorial_cnn_norm_ops_are_named_by_layer_and_form():
  keras.utils.set_random_seed(0)
  model = keras.Sequential(example_models.mnist_cnn_layers())
  spec = [tf.TensorSpec([None, 28, 28, 1]), tf.TensorSpec([None], tf.int32)]
  fn = tf.function(lambda x, y: clipping.clipped_grad_sum(model, x, y, _loss, 1.0)[0],
                   input_signature=spec)
  graph = fn.get_concrete_function().graph
  names = _all_node_names(graph)
  convs = [l for l in model.layers if isinstance(l, keras.layers.Conv2D)]
  assert len(convs) == 2
  forms = {"depthwise", "foldgram", "filter", "unfold"}
  for layer in convs:
    scoped = {f for f in forms if any(f"{layer.name}_{f}_norm/" in n for n in names)}
    assert len(scoped) == 1, (layer.name, scoped)   # one form per layer, named in the graph
  # the same x, y give the same sum with and without the scopes: they only name ops
  x = tf.random.normal([6, 28, 28, 1], seed=1)
  y = tf.constant([0, 1, 2, 3, 4, 5])
  got = fn(x, y)
  want = clipping.clipped_grad_sum(model, x, y, _loss, 1.0)[0]
  for g, w in zip(got, want):
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,form,part", [
    ("conv2d_1", None, "norm"), ("conv2d.x/y", "depthwise", "sum"), ("", "foldgram", "norm"),
    ("_private-conv", "filter", "sum")])
def test_scope_name_is_a_valid_name_scope(name, form, part):
  layer = type("L", (), {"name": name})()
  scope = conv._scope_name(layer, form, part)
  assert scope.endswith(f"_{form or 'unfold'}_{part}")
  with tf.Graph().as_default(), tf.name_scope(scope):   # raises on an invalid scope
    op = tf.constant(0.0, name="probe").op
  assert op.name.startswith(scope + "/")


@pytest.mark.parametrize("op_type,name,part", [
    ("_MklNativeDepthwiseConv2dNativeBackpropFilter",
     "StatefulPartitionedCall/norms/conv2d_2_depthwise_norm/cond/then/_3/map/while/D",
     "norm:conv2d_2:depthwise"),
    ("MulNoNan", "StatefulPartitionedCall/clipped_sum/conv2d_2_depthwise_sum/multiply_no_nan",
     "sum:conv2d_2:depthwise"),
    ("_MklBatchMatMulV2", "norms/conv2d_3_foldgram_norm/map/while/MatMul",
     "norm:conv2d_3:foldgram"),
    ("_MklNativeConv2DBackpropFilterWithBias",
     "StatefulPartitionedCall/gradient_tape/sequential_1/conv2d_1/convolution/"
     "Conv2DBackpropFilter", "weight_grad"),
    ("_MklNativeConv2DBackpropInput",
     "StatefulPartitionedCall/gradient_tape/sequential_1/conv2d_1/convolution/"
     "Conv2DBackpropInput", "backward"),
    ("_MklMatMul", "gradient_tape/sequential_1/dense_1/MatMul/MatMul_1", "weight_grad"),
    ("_MklMatMul", "gradient_tape/sequential_1/dense_1/MatMul/MatMul", "backward"),
    ("_MklNativeFusedConv2D", "StatefulPartitionedCall/forward/dp_sequential_1/conv2d/Relu",
     "forward"),
    ("_MklNativeFusedConv2D", "StatefulPartitionedCall/sequential_1/conv2d_1/Relu", "forward"),
    ("Dataset", "Iterator::Root::Prefetch", "input"),
    ("Sum", "StatefulPartitionedCall/norms/Sum_1", "norms_other"),
    ("MatMul", "StatefulPartitionedCall/clipped_sum/MatMul", "clipped_sum_other"),
    ("StatelessRandomUniformFullIntV2", "StatefulPartitionedCall/stateful_uniform_full_int",
     "noise"),
    ("AssignSubVariableOp", "StatefulPartitionedCall/sgd_1/AssignSubVariableOp_4", "other"),
])
def test_profile_ops_are_attributed_to_their_part(op_type, name, part):
  assert fit_step_split.part_of(op_type, name) == part


def test_split_sums_ops_per_part_without_idle():
  ops = [("IDLE", "IDLE", 50.0, 0.0),
         ("MulNoNan", "clipped_sum/conv2d_depthwise_sum/m", 0.25, 1.0),
         ("Square", "norms/conv2d_depthwise_norm/Square", 1.5, 2.0),
         ("Sum", "norms/conv2d_depthwise_norm/Sum", 0.5, 2.0),
         ("Dataset", "Iterator::Root", 0.125, 1.0)]
  parts = fit_step_split.split(ops)
  assert parts["norm:conv2d:depthwise"] == pytest.approx(2.0)
  assert parts["sum:conv2d:depthwise"] == pytest.approx(0.25)
  assert parts["input"] == pytest.approx(0.125)
  assert parts["total"] == pytest.approx(2.375)
  assert "IDLE" not in parts and list(parts)[0] == "norm:conv2d:depthwise"


def test_op_counts_count_each_run_by_part_per_step():
  events = [("tf_Compute/1", "StatefulPartitionedCall/norms/conv2d_depthwise_norm/Sum:Sum"),
            ("tf_Compute/2", "StatefulPartitionedCall/norms/conv2d_depthwise_norm/Sum:Sum"),
            ("tf_Compute/1", "StatefulPartitionedCall/clipped_sum/add:AddV2"),
            ("tf_Compute/1", "ExecutorState::Process"),           # the executor's own event
            ("tf_Compute/1", "ThreadpoolListener::Record"),
            ("tf_data_private_threadpool/3", "GatherV2:GatherV2"),  # the input pipeline
            ("python", "EagerLocalExecute: ReadVariableOp"),        # an eager op around the step
            ("python", "EagerLocalExecute: __inference_multi_step_on_iterator_3900"),
            ("python", "TFE_Py_FastPathExecute_C")]
  counts = fit_step_split.op_counts(events, steps=2)
  assert counts["norm:conv2d:depthwise"] == pytest.approx(1.0)
  assert counts["clipped_sum_other"] == pytest.approx(0.5)
  assert counts["input"] == pytest.approx(0.5)
  assert counts["eager"] == pytest.approx(0.5)
  assert counts["total"] == pytest.approx(2.5)
  assert list(counts)[0] == "norm:conv2d:depthwise"
