"""keras/internals/runtime (oneDNN, XLA context, loss scale, the train function's call options)
and keras/optimizer/budget_copy: the pieces moved below the optimizer and the models keep
their behaviour."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.eager import context

import tf_dpiter as dp
from tf_dpiter.keras.internals import runtime
from tf_dpiter.keras.optimizer import budget_copy
from tf_dpiter.keras.optimizer import routing


def test_routing_reads_the_same_runtime_functions():
  for name in ("onednn_enabled", "in_xla_context", "loss_scale", "use_vectorized_map",
               "onednn_affected_layers"):
    assert getattr(routing, name) is getattr(runtime, name)


def test_loss_scale_and_xla_context():
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  assert runtime.loss_scale(model) == 1.0
  half = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, dtype="mixed_float16")])
  half.dtype_policy = keras.DTypePolicy("mixed_float16")
  assert runtime.loss_scale(half) == 2.0 ** 7
  assert not runtime.in_xla_context()
  seen = []

  @tf.function(jit_compile=True)
  def f(x):
    seen.append(runtime.in_xla_context())
    return x + 1.0

  f(tf.constant(1.0))
  assert seen == [True]


def test_budget_copy_calibrates_a_plain_optimizer_and_refuses_a_dp_one():
  opt = budget_copy.dp_copy_for_budget(
      keras.optimizers.SGD(0.1), 3.0, 1e-5, 2, 32, 1000, 1.0, "poisson", "rdp", {},
      who="a test")
  assert isinstance(opt, keras.optimizers.SGD) and opt.noise_multiplier > 0
  eps = dp.accounting.compute_dp_sgd_privacy(1000, 32, opt.noise_multiplier, 2, 1e-5).epsilon
  assert eps <= 3.0 + 1e-6 and opt.calibration is not None
  with pytest.raises(ValueError, match="must be a plain keras.optimizers.Optimizer"):
    budget_copy.dp_copy_for_budget(opt, 3.0, 1e-5, 2, 32, 1000, 1.0, "poisson", "rdp", {},
                                   who="a test")


_MEM = rewriter_config_pb2.RewriterConfig


def _grappler_options(options=None):
  """(memory optimization, Grappler's rounds) of function-call options (default: this
  thread's)."""
  options = options or context.context().function_call_options
  rewrite = config_pb2.ConfigProto.FromString(
      options.config_proto_serialized).graph_options.rewrite_options
  return rewrite.memory_optimization, rewrite.meta_optimizer_iterations


_DEFAULT = (_MEM.DEFAULT_MEM_OPT, _MEM.DEFAULT_NUM_ITERS)
_STEP = (_MEM.NO_MEM_OPT, _MEM.ONE)


@pytest.mark.skipif(bool(tf.config.list_logical_devices("GPU")), reason="CPU-only rule")
def test_step_call_options_change_only_the_defaults():
  ctx = context.context()
  outer = ctx.function_call_options
  before = outer.config_proto_serialized
  process = tf.config.optimizer.get_experimental_options()
  assert _grappler_options() == _DEFAULT
  assert _grappler_options(runtime.step_call_options(outer)) == _STEP
  assert ctx.function_call_options.config_proto_serialized == before   # the thread's untouched
  assert tf.config.optimizer.get_experimental_options() == process      # process untouched
  # a memory optimization or a number of rounds the user chose for the thread's calls is kept
  for field, value, expected in (
      ("memory_optimization", _MEM.MANUAL, (_MEM.MANUAL, _MEM.ONE)),
      ("meta_optimizer_iterations", _MEM.TWO, (_MEM.NO_MEM_OPT, _MEM.TWO))):
    chosen = config_pb2.ConfigProto.FromString(before)
    setattr(chosen.graph_options.rewrite_options, field, value)
    assert _grappler_options(runtime.step_call_options(
        context.FunctionCallOptions(outer.executor_type, chosen))) == expected
  both = config_pb2.ConfigProto.FromString(before)
  both.graph_options.rewrite_options.memory_optimization = _MEM.MANUAL
  both.graph_options.rewrite_options.meta_optimizer_iterations = _MEM.TWO
  assert runtime.step_call_options(context.FunctionCallOptions(outer.executor_type, both)) is None


@pytest.mark.skipif(bool(tf.config.list_logical_devices("GPU")), reason="CPU-only rule")
def test_dp_train_function_is_called_with_the_step_call_options():
  """The DP train function's call (its trace runs inside it) carries the options; after the
  step the thread's options are back (a plain model's call carries the default)."""
  keras.utils.set_random_seed(0)
  inp = keras.Input((3,))
  model = dp.keras.DPModel(inp, keras.layers.Dense(2)(inp))
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.01)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  opt.set_sampling(1000, 4 / 1000, "poisson", 4)
  seen = []
  inner = model.train_step
  model.train_step = lambda data: seen.append(_grappler_options()) or inner(data)
  x, y = np.ones((4, 3), "float32"), np.array([0, 1, 0, 1])
  model.train_on_batch(x, y)
  assert seen and set(seen) == {_STEP}
  assert _grappler_options() == _DEFAULT
  # options replaced within the call (a configuration change resets them) are kept
  ctx = context.context()
  outer = ctx.function_call_options
  replaced = context.FunctionCallOptions(
      outer.executor_type, config_pb2.ConfigProto.FromString(outer.config_proto_serialized))

  def replacing(data):
    ctx.function_call_options = replaced
    return inner(data)

  model.train_step = replacing
  model.make_train_function(force=True)
  try:
    model.train_on_batch(x, y)
    assert ctx.function_call_options is replaced
  finally:
    ctx.function_call_options = outer
  model.train_step = lambda data: seen.append(_grappler_options()) or inner(data)
  model.make_train_function(force=True)
  del seen[:]
  plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  plain.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  inner_plain = plain.train_step
  plain.train_step = lambda data: seen.append(_grappler_options()) or inner_plain(data)
  plain.train_on_batch(x, y)
  assert seen == [_DEFAULT]
