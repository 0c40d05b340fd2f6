"""One worker of tf.distribute.MultiWorkerMirroredStrategy on loopback (used by
test_multi_worker): TF_CONFIG comes from the parent; argv: scenario, output JSON path, noise
seed ("none": OS entropy, as in real use; an int: the same seed on every worker).

Scenarios:
  source   MultiWorkerFitMixin + DPSequential on distributed_poisson_batches over an
           ArraySource (one global Poisson sample per step); then a zero-gradient model whose
           weights after the steps are pure noise (their std shows the noise scale)
  unpatched  plain DPSequential on the same data: Keras' own fit under the strategy
  arrays   MultiWorkerFitMixin + DPSequential, fit(x, y, batch_size=B) as on one machine
"""

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402
from tf_dpiter.data import indexed_records  # noqa: E402
from tf_dpiter.data import indexed_sampling  # noqa: E402
from tf_dpiter.keras.model import multi_worker  # noqa: E402

warnings.simplefilter("ignore")
N, B, STEPS, Z, C, LR = 400, 40, 6, 1.25, 1.0, 1.0
WIDE = 3000
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class MultiWorkerDPSequential(multi_worker.MultiWorkerFitMixin, dp.keras.DPSequential):
  pass


def _model(cls, layers, seed):
  model = cls(layers)
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(C, Z, learning_rate=LR, seed=seed),
                loss=LOSS)
  return model


def _ledger(model):
  d = model.ledger.to_dict()
  return {"samples": int(model.ledger.sample_count.numpy()),
          "runs": [{k: r[k] for k in ("count", "policy", "population_size",
                                      "selection_probability")} for r in d["runs"]],
          "epsilon": float(dp.accounting.epsilon(model.ledger, 1e-5))}


def _source_data(strategy, x, y):
  return indexed_sampling.distributed_poisson_batches(
      strategy, indexed_records.ArraySource(x, y), B, STEPS)


def main():
  scenario, out_path, seed = sys.argv[1], sys.argv[2], sys.argv[3]
  seed = None if seed == "none" else int(seed)
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  out = {"replicas": strategy.num_replicas_in_sync, "chief": multi_worker.is_chief(strategy),
         "workers": multi_worker.num_workers(strategy)}
  mine = np.random.default_rng().integers(1, 2**62, size=3)   # differs between workers
  out["own_value"] = [int(v) for v in mine]
  out["broadcast"] = [int(v) for v in multi_worker.broadcast_from_chief(
      strategy, tf.constant(mine, tf.int64)).numpy()]
  rng = np.random.RandomState(0)
  x, y = rng.randn(N, 6).astype("float32"), rng.randint(0, 3, N)
  cls = dp.keras.DPSequential if scenario == "unpatched" else MultiWorkerDPSequential
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = _model(cls, [keras.Input((6,)), keras.layers.Dense(3)], seed)
  try:
    if scenario == "arrays":
      model.fit(x, y, batch_size=B, epochs=1, steps_per_epoch=STEPS, verbose=0)
    else:
      model.fit(_source_data(strategy, x, y), epochs=1, steps_per_epoch=STEPS, verbose=0)
  except ValueError as e:    # reported to the test, which asserts on it
    out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
  else:
    out["ledger"] = _ledger(model)
    out["weights"] = [float(v) for v in np.concatenate([w.ravel() for w in model.get_weights()])]
  if scenario == "source":
    # zero gradients: after STEPS steps each weight is the sum of STEPS noise draws of
    # std lr z C / (q n) = lr z C / B (Poisson: the denominator is the expected batch size)
    with strategy.scope():
      noisy = _model(cls, [keras.Input((6,)), keras.layers.Dense(WIDE, use_bias=False,
                                                                   kernel_initializer="zeros"),
                           keras.layers.Lambda(lambda t: 0.0 * t[:, :3])], seed)
    noisy.fit(_source_data(strategy, x, y), epochs=1, steps_per_epoch=STEPS, verbose=0)
    w = noisy.get_weights()[0]
    out["noise_std_ratio"] = float(w.std() / (np.sqrt(STEPS) * LR * Z * C / B))
    out["noise_draws"] = int(w.size)
    out["noise_head"] = [float(v) for v in w.reshape(-1)[:16]]
    out["noisy_ledger_samples"] = int(noisy.ledger.sample_count.numpy())
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(out, f)


if __name__ == "__main__":
  sys.exit(main())
