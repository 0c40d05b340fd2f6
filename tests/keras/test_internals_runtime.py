"""keras/internals/runtime (oneDNN, XLA context, loss scale) and keras/optimizer/budget_copy:
the pieces moved below the optimizer and the models keep their behaviour."""

import keras
import pytest
import tensorflow as tf

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
