"""Where the DP `model.fit` step's time goes against the non-private one (issue 42, item 2).

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/fit_overhead_breakdown.py [--model cnn|mlp]
      [--batch 256] [--steps 32] [--rounds 5] [--calls 20]

Everything runs in ONE process, in two phases, each round robin (--rounds rounds):

Phase A, before any `fit` on arrays (no sampling pipeline has run in the process yet), one
tf.function each, timed as --calls calls per round (figure: the median over rounds of wall
and of process CPU time per call, and of the minor page faults per call):
  np_train_step     keras.Model.train_step of the non-private model (SGD) on one batch of B
  dp_train_step     DPModel.train_step on the same batch with weights 1 (sampling declared by
                    optimizer.set_sampling): clipped sum, noise, ledger write, update, loss
  dp_clipped_sum    the clipped sum alone (`_dp_clipped_sum_step`: forward, backward, ghost
                    norms by the layer rules, clipped sum; no noise, no ledger, no update)
  dp_noise          the Gaussian query's own get_noised_result on a zero sum, divided by the
                    expected batch size (`compiled_noised_average`): the noise draw, no ledger
  dp_noise_ledger   `noised_average` on a zero sum: the noise draw, the ledger write
                    (in-graph reconcile and append) and the query's global-state update
  dp_update         `noised_average` on a zero sum, then apply_private_gradients of its
                    result (a custom loop's step: the update must apply a noised result);
                    the optimizer's update alone is dp_update - dp_noise_ledger
Phase B, the same functions again after these `fit` configurations (--steps steps per epoch,
one epoch per round after a warm-up epoch; figure: the median over rounds of epoch wall time
/ steps, and of the epoch's minor page faults / steps):
  np_fit_arrays     keras fit(x, y, batch_size=B) on n = 60000 records (Keras' shuffled batches)
  dp_fit_arrays     DP fit(x, y, batch_size=B): Poisson samples (tf.data pipeline of
                    tf_dpiter.data.sampling), one ledger sample per step
  dp_fit_fixed      DP fit on one fixed batch of B repeated (no sampling pipeline)
  np_fit_fixed      the non-private fit on that batch
Differences then attribute the DP step's extra time: the layer rules (dp_clipped_sum -
np_train_step), the noise, the ledger write (dp_noise_ledger - dp_noise), the update
(dp_update - dp_noise_ledger), Keras' fit loop and the DP callbacks (dp_fit_fixed -
dp_train_step against np_fit_fixed - np_train_step), the sampling pipeline (dp_fit_arrays -
dp_fit_fixed), and the process state (phase B - phase A of the same function). Data: random
MNIST-shaped records. Prints one JSON line (load average at start and end: the machine may be
shared).
"""

import argparse
import json
import os
import resource
import statistics
import time
import warnings

N_POP = 60000


def _parse():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--calls", type=int, default=20)
  return p.parse_args()


def _faults():
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _models(a):
  """(non-private model, DP model) compiled as benchmarks/fit_step_time.py compiles them."""
  import keras  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  ex = dp.keras.example_models
  layers = ex.mnist_cnn_layers if a.model == "cnn" else ex.mlp_layers
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  keras.utils.set_random_seed(0)
  np_model = keras.Sequential(layers())
  np_model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
  keras.utils.set_random_seed(0)
  dp_model = dp.keras.DPSequential(layers())
  dp_model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                   loss=loss)
  return np_model, dp_model


def _functions(np_model, dp_model, batch):
  """{name: a call that runs one tf.function and waits for its result} (module docstring)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x, y, w = (tf.constant(t) for t in batch)
  step = dp_model.optimizer.private_step
  variables = dp_model.trainable_variables
  zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
  b = tf.constant(float(x.shape[0]))
  query = step.require_query()

  def zero_state():
    return query.sample_state_of_sum(zeros, [tf.identity(z) for z in zeros])

  def update():
    dp_model.optimizer.apply_private_gradients(step.noised_average(zero_state(), b), variables)
    return variables[0][(0,) * len(variables[0].shape)]

  fns = {
      "np_train_step": tf.function(lambda: np_model.train_step((x, y))["loss"]),
      "dp_train_step": tf.function(lambda: dp_model.train_step((x, y, w))["loss"]),
      "dp_clipped_sum": tf.function(lambda: tf.nest.flatten(dp_model._dp_clipped_sum_step(  # pylint: disable=protected-access
          x, y, w, step.sample_params(), outputs=False)[0])[0]),
      "dp_noise": tf.function(lambda: step.compiled_noised_average(
          zero_state(), b, step.global_state())[0][0]),
      "dp_noise_ledger": tf.function(lambda: step.noised_average(zero_state(), b)[0]),
      "dp_update": tf.function(update),
  }
  return {k: (lambda f=f: f().numpy()) for k, f in fns.items()}


def _time_functions(fns, rounds, calls):
  """{name: (median wall ms, median CPU ms, median minor faults) per call}."""
  for f in fns.values():
    f()
    f()
  wall, cpu, flt = ({k: [] for k in fns} for _ in range(3))
  for _ in range(rounds):
    for k, f in fns.items():
      t, c, p = time.perf_counter(), time.process_time(), _faults()
      for _ in range(calls):
        f()
      wall[k].append((time.perf_counter() - t) / calls)
      cpu[k].append((time.process_time() - c) / calls)
      flt[k].append((_faults() - p) / calls)
  med = statistics.median
  return {k: (round(1e3 * med(wall[k]), 3), round(1e3 * med(cpu[k]), 3), round(med(flt[k])))
          for k in fns}


def _time_fits(configs, rounds, steps):
  """{name: (median wall ms per step of an epoch, median minor faults per step)}."""
  import keras  # pylint: disable=g-import-not-at-top

  class EpochTimer(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.wall, self.faults = [], []

    def on_epoch_begin(self, epoch, logs=None):
      self._t, self._f = time.perf_counter(), _faults()

    def on_epoch_end(self, epoch, logs=None):
      self.wall.append((time.perf_counter() - self._t) / steps)
      self.faults.append((_faults() - self._f) / steps)

  timers = {k: EpochTimer() for k in configs}
  for m, kw in configs.values():
    m.fit(**kw, epochs=1, verbose=0)
  for _ in range(rounds):
    for k, (m, kw) in configs.items():
      m.fit(**kw, epochs=1, verbose=0, callbacks=[timers[k]])
  return {k: (round(1e3 * statistics.median(t.wall), 3), round(statistics.median(t.faults)))
          for k, t in timers.items()}


def main():
  a = _parse()
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  warnings.simplefilter("ignore")
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = {"model": a.model, "batch": a.batch, "steps": a.steps, "rounds": a.rounds,
         "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"), "tf": tf.__version__,
         "keras": keras.__version__, "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}
  rng = np.random.RandomState(0)
  shape = (28, 28, 1) if a.model == "cnn" else (784,)
  xs = rng.rand(N_POP, *shape).astype("float32")
  ys = rng.randint(0, 10, N_POP).astype("int32")
  batch = (xs[:a.batch], ys[:a.batch], np.ones(a.batch, "float32"))
  np_fixed, dp_fixed = _models(a)
  dp_fixed.optimizer.set_sampling(N_POP, a.batch / N_POP, "poisson", a.batch)
  fixed_np = dict(x=tf.data.Dataset.from_tensors(batch[:2]).repeat(), steps_per_epoch=a.steps)
  fixed_dp = dict(x=tf.data.Dataset.from_tensors(batch).repeat(), steps_per_epoch=a.steps)
  np_fixed.fit(**fixed_np, epochs=1, verbose=0)   # builds the models and their optimizers
  dp_fixed.fit(**fixed_dp, epochs=1, verbose=0)
  fns = _functions(np_fixed, dp_fixed, batch)
  out["phase_a_functions_wall_cpu_ms_faults"] = _time_functions(fns, a.rounds, a.calls)
  np_arrays, dp_arrays = _models(a)
  arrays = dict(x=xs, y=ys, batch_size=a.batch, steps_per_epoch=a.steps)
  out["fits_ms_per_step_faults"] = _time_fits({
      "np_fit_arrays": (np_arrays, arrays), "dp_fit_arrays": (dp_arrays, arrays),
      "dp_fit_fixed": (dp_fixed, fixed_dp), "np_fit_fixed": (np_fixed, fixed_np)},
                                              a.rounds, a.steps)
  out["phase_b_functions_wall_cpu_ms_faults"] = _time_functions(fns, a.rounds, a.calls)
  out["ledger_samples"] = {"dp_fit_arrays": int(dp_arrays.ledger.sample_count.numpy())}
  out["load_avg_end"] = os.getloadavg()
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
