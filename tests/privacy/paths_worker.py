"""Fresh-process worker of test_neighbouring_paths: `mirrored` (2 logical CPU devices,
MirroredStrategy) or `onednn` (TF_ENABLE_ONEDNN_OPTS=1 set by the caller before TensorFlow
starts). Prints one line `RESULT {json}`. Imported (not run as a script), it configures no
device and its `onednn()` runs in the importer's process (onednn_loop_worker's "paths:onednn"
case, the default suite's run of it)."""

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

MODE = sys.argv[1] if __name__ == "__main__" else None
if MODE == "mirrored":
  _cpus = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402
from tf_dpiter.auditing import sensitivity  # noqa: E402
from tf_dpiter.keras.optimizer import routing  # noqa: E402

warnings.simplefilter("ignore")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
B, N = 8, 1000


def _sum(model, w0, x, y, mask):
  """The weight change of one noise-free step at lr 1: the clipped sum (float32 weights)."""
  model.set_weights(w0)
  model.train_on_batch(x, y, sample_weight=mask)
  return np.concatenate([(np.asarray(a, np.float64) - np.asarray(b, np.float64)).ravel()
                         for a, b in zip(w0, model.get_weights())])


def _fit_sum(model, w0, x, y, mask):
  """As _sum through fit on a one-batch dataset (the strategy splits it among replicas)."""
  model.set_weights(w0)
  model.fit(tf.data.Dataset.from_tensor_slices((x, y, mask)).batch(len(x)), epochs=1, verbose=0)
  return np.concatenate([(np.asarray(a, np.float64) - np.asarray(b, np.float64)).ravel()
                         for a, b in zip(w0, model.get_weights())])


def mirrored():
  """Add/remove neighbours (and adversarial additions) of the real step under the strategy."""
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  out = {"replicas": strategy.num_replicas_in_sync}
  rng = np.random.RandomState(0)
  x = rng.randn(B, 6).astype("float32") * 3
  y = rng.randint(0, 3, B)
  for clipping in ("vectorized", "fast"):
    with strategy.scope():
      keras.utils.set_random_seed(0)
      model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                                     keras.layers.Dense(3)])
      model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(
          1.0, 0.0, learning_rate=1.0, clipping=clipping, normalize=False), loss=LOSS)
    model.optimizer.set_sampling(N, B / N, "poisson", B)
    try:
      model.train_on_batch(x, y)
      out["train_on_batch_refused"] = False
    except ValueError as e:
      out["train_on_batch_refused"] = "tf.data.Dataset" in str(e)
    w0 = [np.array(w) for w in model.get_weights()]
    mask = np.ones(B, "float32")
    mask[-1] = 0.0       # the last row is padding: an absent example
    base = _fit_sum(model, w0, x, y, mask)
    changes = []
    for j in range(B - 1):          # remove example j
      m2 = mask.copy()
      m2[j] = 0.0
      changes.append(np.linalg.norm(_fit_sum(model, w0, x, y, m2) - base))
    for _ in range(8):              # add an adversarial example in the padding row
      x2, y2, m2 = x.copy(), y.copy(), np.ones(B, "float32")
      x2[-1] = rng.randn(6) * rng.choice([0.1, 10.0, 100.0])
      y2[-1] = rng.randint(3)
      changes.append(np.linalg.norm(_fit_sum(model, w0, x2, y2, m2) - base))
    out[f"{clipping}_path"] = model.optimizer.resolve_clipping(model)
    out[f"{clipping}_max_change"] = float(max(changes))
    out[f"{clipping}_recorded"] = float(max(
        q["sensitivity"] for q in model.ledger.to_dict()["runs"][-1]["queries"]))
  return out


def _attention_model():
  keras.utils.set_random_seed(0)
  inp = keras.Input((5, 8))
  h = keras.layers.MultiHeadAttention(2, 4, name="mha")(inp, inp)
  h = keras.layers.EinsumDense("btd,dk->btk", output_shape=(5, 3), name="einsum")(h)
  out = keras.layers.Dense(3)(keras.layers.Flatten()(h))
  return dp.keras.DPModel(inp, out)


def onednn():
  """Vectorized path under oneDNN vs a per-example loop, and the sensitivity check."""
  out = {"onednn": routing.onednn_enabled()}
  model = _attention_model()
  out["affected"] = sorted(routing.onednn_affected_layers(model))
  out["use_vectorized_map"] = routing.use_vectorized_map(model)
  clip = 0.05
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(
      clip, 0.0, learning_rate=1.0, clipping="vectorized", normalize=False), loss=LOSS)
  model.optimizer.set_sampling(N, 6 / N, "poisson", 6)
  rng = np.random.RandomState(0)
  x, y = rng.randn(6, 5, 8).astype("float32"), rng.randint(0, 3, 6)
  w0 = [np.array(w) for w in model.get_weights()]
  got = _sum(model, w0, x, y, np.ones(6, "float32"))
  model.set_weights(w0)
  ref = 0.0
  for i in range(6):                # the per-example loop: gradient, clip, sum (float64)
    with tf.GradientTape() as tape:
      loss = LOSS(y[i:i + 1], model(x[i:i + 1]))
    g = np.concatenate([np.asarray(t, np.float64).ravel()
                        for t in tape.gradient(loss, model.trainable_variables)])
    ref = ref + g * min(1.0, clip / np.linalg.norm(g))
  out["max_abs_diff"] = float(np.max(np.abs(got - ref)))
  out["sum_norm"] = float(np.linalg.norm(ref))
  report = sensitivity.check_sensitivity(model, np.concatenate([x, x[::-1] * 2]),
                                         np.concatenate([y, y]), num_candidates=4, batch_size=6)
  out["check_passed"] = report.passed
  out["check_ratio"] = report.ratio
  out["check_path"] = report.path
  return out


if __name__ == "__main__":
  print("RESULT " + json.dumps(mirrored() if MODE == "mirrored" else onednn()))
