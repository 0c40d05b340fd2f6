"""Run by test_mirrored_strategy: two logical CPUs, MirroredStrategy.

Each replica clips its half of the batch; the sum over replicas must equal the
single-device clipped sum of the whole batch. Prints 'OK <max abs diff>'.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras  # pylint: disable=g-import-not-at-top

from tf_dpiter.keras import fast_clipping  # pylint: disable=g-import-not-at-top


def loss_fn(y_true, y_pred):
  return tf.reduce_sum(tf.square(y_true - y_pred), axis=-1)


strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([
      keras.Input((6, 4)),
      keras.layers.Conv1D(3, 2, activation="tanh"),
      keras.layers.LayerNormalization(),
      keras.layers.PReLU(),
      keras.layers.Flatten(),
      keras.layers.Dense(2),
  ])
rng = np.random.default_rng(0)
x = rng.normal(size=(8, 6, 4)).astype(np.float32)
y = rng.normal(size=(8, 2)).astype(np.float32)
ref, _ = fast_clipping.clipped_grad_sum(model, x, y, loss_fn, 0.5)

ds = strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)).batch(8))


@tf.function
def step(batch):
  def replica_fn(xb, yb):
    grads, _ = fast_clipping.clipped_grad_sum(model, xb, yb, loss_fn, 0.5)
    return grads
  per_replica = strategy.run(replica_fn, args=batch)
  return [strategy.reduce("SUM", g, axis=None) for g in per_replica]


out = step(next(iter(ds)))
diff = max(float(np.max(np.abs(a - b))) for a, b in zip(out, ref))
print("OK" if diff < 1e-5 else "MISMATCH", diff)
