"""Worker of test_custom_loop_late_writes (review R9, session 40, finding 3): a custom loop under a 2-replica
MirroredStrategy (two logical CPUs, set before TensorFlow starts) whose replica function is
itself a tf.function and whose outer tf.function sets the learning rate from a batch mean the
replicas return. Prints "STATED <epsilon> <lr>" or "REFUSED <message>".

Usage: python late_writes_mirrored_worker.py ROUTE (nested | none).
"""

import sys

import numpy as np
import tensorflow as tf

CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import tf_dpiter as dp  # noqa: E402
from tf_dpiter.keras.model import statement as statement_lib  # noqa: E402


def main(route):
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  rng = np.random.default_rng(0)
  x = rng.normal(size=(10, 4)).astype(np.float32)
  x[0, 0] = 3000.0
  y = rng.normal(size=(10, 1)).astype(np.float32)
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1)
    opt.build(model.trainable_variables)
  opt.set_sampling(100, 0.1, "poisson", 10)
  batch = next(iter(strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(10))))

  @tf.function
  def replica_step(xb, yb):
    grads = opt.compute_private_gradients(
        lambda rec: tf.reduce_mean(tf.square(model(rec[0]) - rec[1])),
        model.trainable_variables, data=(xb, yb), model=model)
    opt.apply_private_gradients(grads, model.trainable_variables)
    return tf.reduce_mean(tf.abs(xb))

  @tf.function
  def step():
    means = strategy.run(replica_step, args=batch)
    if route == "nested":   # a data-adapted rate for the next step
      opt.learning_rate.assign(0.1 * strategy.reduce("MEAN", means, axis=None))

  step()
  step()
  try:
    stated = statement_lib.run_statement(opt, 1e-5)
  except dp.errors.PrivacyConfigError as e:
    print("REFUSED", str(e)[:200])
    return
  print("STATED", stated.epsilon, float(opt.learning_rate.numpy()))


if __name__ == "__main__":
  main(sys.argv[1])
