"""The DP optimizer's update of the noised averages: Keras' sum over the replicas before the
update is skipped under one replica (the value itself, formed by Keras through one Identity per
variable) and kept under several (noised_average divides by their number for it)."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp


def _setup():
  keras.utils.set_random_seed(0)
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.5)
  variables = [keras.Variable(np.arange(6, dtype="float32").reshape(2, 3)),
               keras.Variable(np.ones(3, "float32"))]
  opt.build(variables)
  grads = [tf.constant(np.linspace(-1.0, 2.0, 6, dtype="float32").reshape(2, 3)),
           tf.constant([0.25, -0.5, 4.0])]
  return opt, variables, grads


def _charge_one_sample(opt, variables):
  """One private step's ledger sample: apply_private_gradients applies one charged step per
  update (the update below applies the given values instead of its result)."""
  opt.set_sampling(10, 0.1, "poisson", 1)
  opt.compute_private_gradients(lambda r: tf.reduce_sum(variables[1] * r), variables[1:],
                                data=tf.ones([1, 3]))
  # the updates below apply given values, as the library's own train step applies its own
  # noised result: the binding of an update to its noised result (update_binding) is skipped
  # there only
  opt._dp_fingerprints_deferred = True  # pylint: disable=protected-access
  opt._dp_own_step = True  # pylint: disable=protected-access


def test_one_replica_update_is_exact_and_traces_no_identity():
  opt, variables, grads = _setup()
  _charge_one_sample(opt, variables)
  before = [v.numpy().astype("float64") for v in variables]

  @tf.function
  def step(g0, g1):
    opt.apply_private_gradients([g0, g1], variables)

  graph = step.get_concrete_function(*grads).graph
  # Keras' all-reduce would pass each gradient through an Identity (IdentityN); the step's
  # own reads (the charged-update check's ledger reads and assertion) are not gradients
  inputs = {t.name for t in graph.inputs}
  passed = [op.name for op in graph.get_operations() if op.type in ("Identity", "IdentityN")
            and any(t.name in inputs for t in op.inputs)]
  assert not passed, passed
  step(*grads)
  for v, b, g in zip(variables, before, grads):
    np.testing.assert_array_equal(v.numpy(), (b - 0.5 * g.numpy().astype("float64")).astype(
        "float32"))


def mirrored_update_check(strategy):
  """Under `strategy` (a MirroredStrategy on 2 logical CPUs), each replica hands on its value
  / 2 (as noised_average does) and the update is their sum: Keras' all-reduce is kept. Raises
  otherwise; prints "OK <replicas>"."""
  with strategy.scope():
    opt, variables, grads = _setup()
  _charge_one_sample(opt, variables)
  before = [v.numpy() for v in variables]

  @tf.function
  def step():
    strategy.run(lambda: opt.apply_private_gradients([g / 2.0 for g in grads], variables))

  step()
  for v, b, g in zip(variables, before, grads):
    np.testing.assert_allclose(v.numpy(), b - 0.5 * g.numpy(), rtol=1e-6, atol=1e-6)
  print("OK", strategy.num_replicas_in_sync, flush=True)


def check_mirrored(lines):
  """`mirrored_update_check`'s stdout `lines` show it passed on 2 replicas."""
  assert "OK 2" in lines, lines


_MIRRORED = """
import tensorflow as tf
physical = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(physical[0], [tf.config.LogicalDeviceConfiguration()] * 2)
from tests.keras import test_apply_replicas as t
t.mirrored_update_check(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
"""


@pytest.mark.slow
def test_several_replicas_still_sum_over_replicas():
  """Two logical CPUs under MirroredStrategy (a subprocess: the devices are set before
  TensorFlow starts): Keras' all-reduce is kept, so the update is the sum of the replicas'
  values. The default suite runs `mirrored_update_check` in the MirroredStrategy process that
  tests/keras/test_distribute.py shares among its jobs (`check_mirrored` there); this
  process of its own runs with -m slow."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
             TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run([sys.executable, "-c", _MIRRORED], capture_output=True, text=True,
                        timeout=300, env=env, cwd=root, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  check_mirrored(proc.stdout.splitlines())
