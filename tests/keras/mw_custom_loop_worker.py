"""One worker of MultiWorkerMirroredStrategy (loopback) for test_multi_worker_custom_loop: a
custom loop (compute_private_gradients + apply_private_gradients in strategy.run) on
distributed_poisson_batches; a zero-gradient model, so its weights after STEPS steps are the
noise alone. argv: output JSON path, then "sync" to call optimizer.synchronize_noise first.
TF_CONFIG from the parent."""
import json, os, sys, warnings
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
import keras
import numpy as np
import tf_dpiter as dp
from tf_dpiter.data import indexed_records, indexed_sampling
from tf_dpiter.keras.model import multi_worker
warnings.simplefilter("ignore")
N, B, STEPS, Z, C, LR, WIDE = 400, 40, 6, 1.25, 1.0, 1.0, 3000
out_path = sys.argv[1]
strategy = tf.distribute.MultiWorkerMirroredStrategy()
out = {"replicas": strategy.num_replicas_in_sync, "workers": multi_worker.num_workers(strategy)}
rng = np.random.RandomState(0)
x, y = rng.randn(N, 6).astype("float32"), np.zeros((N, 3), "float32")
try:
  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(WIDE, use_bias=False, kernel_initializer="zeros"),
                              keras.layers.Lambda(lambda t: 0.0 * t[:, :3])])
    opt = dp.keras.DPKerasSGDOptimizer(C, Z, learning_rate=LR)
    opt.build(model.trainable_variables)
  opt.set_sampling(N, B / N, "poisson", B)
  if sys.argv[2:] == ["sync"]:
    opt.synchronize_noise(strategy)
  ds = indexed_sampling.distributed_poisson_batches(strategy, indexed_records.ArraySource(x, y), B, STEPS)
  it = iter(ds)
  variables = model.trainable_variables
  def replica_fn(batch):
    xb, yb, wb = batch
    grads = opt.compute_private_gradients(
        lambda r: keras.losses.mean_squared_error(r[1], model(r[0], training=True)), variables,
        data=(xb, yb), mask=wb)
    return opt.apply_private_gradients(grads, variables)
  @tf.function
  def step(batch):
    strategy.run(replica_fn, args=(batch,))
  for _ in range(STEPS):
    step(next(it))
  w = model.get_weights()[0]
  out["noise_std_ratio"] = float(w.std() / (np.sqrt(STEPS) * LR * Z * C / B))
  out["head"] = [float(v) for v in w.reshape(-1)[:3]]
  out["ledger"] = int(opt.ledger.sample_count.numpy())
  out["iterations"] = int(opt.iterations.numpy())
except (ValueError, TypeError, RuntimeError, tf.errors.OpError) as e:   # reported
  out["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
with open(out_path, "w") as f:
  json.dump(out, f)
