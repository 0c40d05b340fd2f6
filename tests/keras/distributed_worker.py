"""Run under a fresh process: 2 logical CPU devices, MirroredStrategy (used by test_distribute)."""

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

cpus = tf.config.list_physical_devices("CPU")
if tf.config.get_logical_device_configuration(cpus[0]) is None:   # once per process
  tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402

warnings.simplefilter("ignore")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
B = 8


def build(strategy, clip, z, seed=None, clipping="vectorized", microbatches=None):
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
                                   keras.layers.Dense(3)])
    model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(clip, z, microbatches, learning_rate=1.0,
                                                         seed=seed, clipping=clipping), loss=LOSS)
  model.optimizer.set_sampling(1000, B / 1000, "shuffle", B)
  return model


def main(strategy=None):
  """Prints one RESULT json line; `strategy`: a MirroredStrategy on the 2 CPUs to share
  (mirrored_jobs_worker: one per process, collective instance keys are per strategy)."""
  out = {}
  strategy = strategy or tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  out["replicas"] = strategy.num_replicas_in_sync
  rng = np.random.RandomState(0)
  x = rng.randn(B, 6).astype("float32")
  y = rng.randint(0, 3, B)
  # 1) noise 0: the mirrored step equals the single-device step
  single = build(tf.distribute.get_strategy(), 0.05, 0.0)
  single(x)
  mirrored = build(strategy, 0.05, 0.0)
  mirrored(x)
  mirrored.set_weights(single.get_weights())
  w0 = [w.copy() for w in single.get_weights()]
  single.train_on_batch(x, y)
  ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
  mirrored.fit(ds, epochs=1, verbose=0)
  out["max_abs_diff"] = float(max(np.abs(a - b).max() for a, b in zip(single.get_weights(),
                                                                        mirrored.get_weights())))
  out["update_norm"] = float(np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(
      w0, single.get_weights()))))
  out["ledger_after_1"] = int(mirrored.ledger.sample_count.numpy())
  # 1b) the fast path (ghost norms) under the strategy: per example against one device (the
  #     single-device step of 1: the per-example clipped update is the same on either path),
  #     and with 2 microbatches per replica against the vectorized path under the strategy
  for mb in (None, 2):
    fast = build(strategy, 0.05, 0.0, clipping="fast", microbatches=mb)
    fast(x)
    fast.set_weights(w0)
    if mb is None:
      ref = single
    else:
      ref = build(strategy, 0.05, 0.0, clipping="vectorized", microbatches=mb)
      ref(x)
      ref.set_weights(w0)
      ref.fit(ds, epochs=1, verbose=0)
    fast.fit(ds, epochs=1, verbose=0)
    out[f"fast_max_abs_diff_{mb}"] = float(max(
        np.abs(a - b).max() for a, b in zip(ref.get_weights(), fast.get_weights())))
    out[f"fast_update_{mb}"] = float(max(
        np.abs(a - b).max() for a, b in zip(w0, fast.get_weights())))
    out[f"fast_clipping_{mb}"] = fast.optimizer.resolve_clipping(fast)
  # 2) noise on zero gradients (clip tiny, data irrelevant): stddev of the update is
  #    lr z C / B if noise is drawn once, sqrt(2) times that if once per replica.
  z, c = 1.0, 1.0
  with strategy.scope():
    noisy = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(2000, use_bias=False,
                                                                          kernel_initializer="zeros"),
                                   keras.layers.Lambda(lambda t: 0.0 * t[:, :3])])
    noisy.compile(optimizer=dp.keras.DPKerasSGDOptimizer(c, z, learning_rate=1.0, seed=3,
                                                         clipping="vectorized"), loss=LOSS)
  noisy.optimizer.set_sampling(1000, B / 1000, "shuffle", B)
  steps = 10
  noisy.fit(tf.data.Dataset.from_tensor_slices((np.repeat(x, steps, 0), np.repeat(y, steps))).batch(B),
            epochs=1, verbose=0)
  k = noisy.layers[0].kernel
  kv = getattr(k, "value", k)
  per_replica = [v.numpy() for v in kv.values] if hasattr(kv, "values") else None
  w = noisy.get_weights()[0]
  out["ledger_noisy"] = int(noisy.ledger.sample_count.numpy())
  # after `steps` independent steps the weight std is sqrt(steps) * lr z C / B
  out["std_ratio"] = float(w.std() / (np.sqrt(steps) * z * c / B))
  out["num_draws"] = int(w.size)
  out["replicas_equal"] = None if per_replica is None else bool(
      all(np.array_equal(per_replica[0], p) for p in per_replica))
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  sys.exit(main())
