"""Where the DP `model.fit` step loses time against the bare fast-clipping step (issue 18).

  python benchmarks/fit_path_profile.py [--models cnn,mlp] [--batch 256] [--epochs 5]
                                        [--steps 20] [--onednn default|0|1]

Measures in ONE process, round robin (every configuration once per round, --epochs rounds;
each round is one epoch of --steps steps; figure: the median over rounds of the epoch's wall
time / steps, timed by a callback at epoch begin and end):
  fit_nonprivate_spe{1,8,32}   keras.Sequential + SGD through model.fit, steps_per_execution k
  fit_dp_spe{1,8,32}           DPSequential + DPKerasSGDOptimizer(clipping="fast") through
                               model.fit on a fixed batch of B with weight 1 (no padding),
                               sampling declared with optimizer.set_sampling (poisson)
  fit_dp_poisson               the same through fit(x, y, batch_size=B) on arrays (n = 60000):
                               Poisson indices drawn in Python, rows gathered by tf.data
                               (unpadded without XLA since issue 18, session 6)
  fit_dp_poisson_unpadded      dp.data.poisson_batches(..., max_batch_size=None): no padding
  fit_dp_by_index              poisson_batches_from_source(ArraySource): O(q n) index draw
  fit_dp_in_graph              dp.data graph_sampling.poisson_batches_in_graph: drawn and
                               gathered by TF ops in tf.data (no Python generator)
and, as one tf.function each (median of --steps * --epochs calls):
  bare_nonprivate, bare_fast   benchmarks/fast_clipping_step_time.py's steps (forward,
                               backward / ghost-norm clipping, noise, SGD update)
  bare_fast_no_noise           the fast step without the noise draw
  noise_only                   the library's Gaussian draw on the model's shapes
  noised_average               optimizer.private_step.noised_average on a zero clipped sum: noise + ledger
                               write + query state update, as the DP train_step calls it
The ratios printed are within one run. Data: random, MNIST-shaped (28x28x1 / 784).
"""

import argparse
import json
import os
import statistics
import time
import warnings


def _parse():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default="cnn,mlp")
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--epochs", type=int, default=5, help="rounds (one epoch per config each)")
  p.add_argument("--steps", type=int, default=64,
                 help="steps per epoch (a multiple of 32)")
  p.add_argument("--configs", default="",
                 help="comma-separated fit configurations to time (default: all + functions)")
  p.add_argument("--onednn", choices=["default", "0", "1"], default="default")
  return p.parse_args()


ARGS = _parse()
if ARGS.onednn != "default":
  os.environ["TF_ENABLE_ONEDNN_OPTS"] = ARGS.onednn
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fast_clipping_step_time as bare  # noqa: E402
import tf_dpiter as dp  # noqa: E402
from tf_dpiter.data import graph_sampling  # noqa: E402
from tf_dpiter.data import indexed_records  # noqa: E402
from tf_dpiter.data import indexed_sampling  # noqa: E402
from tf_dpiter.keras.optimizer import optimizers as opt_lib  # noqa: E402

N_POP = 60000
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class EpochTimer(keras.callbacks.Callback):
  def __init__(self):
    super().__init__()
    self.times = []

  def on_epoch_begin(self, epoch, logs=None):
    self._t = time.perf_counter()

  def on_epoch_end(self, epoch, logs=None):
    self.times.append(time.perf_counter() - self._t)


def _layers(name):
  ex = dp.keras.example_models
  return ex.mnist_cnn_layers() if name == "cnn" else ex.mlp_layers()


def _data(name, b):
  rng = np.random.RandomState(0)
  x = rng.rand(b, *((28, 28, 1) if name == "cnn" else (784,))).astype("float32")
  return x, rng.randint(0, 10, b).astype("int32")


def _fit_config(name, kind, spe, b, steps):
  """(model, fit kwargs) of one fit configuration; fit is then called once per round."""
  keras.utils.set_random_seed(0)
  x, y = _data(name, b)
  if kind == "nonprivate":
    model = keras.Sequential(_layers(name))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS, steps_per_execution=spe)
    ds = tf.data.Dataset.from_tensors((x, y)).repeat()
    return model, dict(x=ds, steps_per_epoch=steps)
  model = dp.keras.DPSequential(_layers(name))
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1,
                                                       clipping="fast"),
                loss=LOSS, steps_per_execution=spe)
  if kind == "dp":
    model.optimizer.set_sampling(N_POP, b / N_POP, "poisson", b)
    ds = tf.data.Dataset.from_tensors((x, y, np.ones(b, "float32"))).repeat()
    return model, dict(x=ds, steps_per_epoch=steps)
  xs, ys = _data(name, N_POP)
  if kind == "dp_poisson":         # arrays: fit samples by Poisson itself (padded)
    return model, dict(x=xs, y=ys, batch_size=b, steps_per_epoch=steps)
  if kind == "dp_in_graph":
    ds = graph_sampling.poisson_batches_in_graph(xs, ys, b, steps_per_epoch=steps)
  elif kind == "dp_poisson_unpadded":
    ds = dp.data.poisson_batches(xs, ys, b, steps_per_epoch=steps, max_batch_size=None)
  else:                            # dp_by_index: Binomial count + uniform subset, padded
    ds = indexed_sampling.poisson_batches_from_source(indexed_records.ArraySource(xs, ys), b,
                                                      steps_per_epoch=steps)
  return model, dict(x=ds)


def _fit_rounds(configs, rounds):
  timers = {k: EpochTimer() for k in configs}
  for k, (model, kw) in configs.items():      # warm-up: tracing, first steps
    model.fit(**kw, epochs=1, verbose=0)
  for _ in range(rounds):
    for k, (model, kw) in configs.items():
      model.fit(**kw, epochs=1, verbose=0, callbacks=[timers[k]])
  return {k: statistics.median(t.times) for k, t in timers.items()}


def _median_call(fn, calls):
  fn()
  fn()
  out = []
  for _ in range(calls):
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  return statistics.median(out)


def _functions(name, b, dp_model):
  """tf.functions timed alone (see module docstring)."""
  x, y = (tf.constant(t) for t in _data(name, b))
  fns = {}
  for mode, key in (("nonprivate", "bare_nonprivate"), ("fast", "bare_fast"),
                    ("fast_no_noise", "bare_fast_no_noise")):
    step = bare.make_step(bare.build_model(name), mode, False)
    fns[key] = lambda step=step: step(x, y).numpy()
  variables = dp_model.trainable_variables
  zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
  noise = tf.function(lambda: bare._noised(zeros))  # pylint: disable=protected-access
  fns["noise_only"] = lambda: [t.numpy() for t in noise()][0]
  opt = dp_model.optimizer

  @tf.function
  def noised_average():
    query = opt.dp_query
    state = query.initial_sample_state(opt_lib.wide_template(variables))
    state = query.accumulate_preprocessed_record(state, zeros)
    return opt.private_step.noised_average(state, tf.constant(float(b)))

  fns["noised_average"] = lambda: noised_average()[0].numpy()
  return fns


def profile(name, a):
  configs = {f"fit_{kind}_spe{spe}": _fit_config(name, kind, spe, a.batch, a.steps)
             for kind in ("nonprivate", "dp") for spe in (1, 8, 32)}
  for kind in ("dp_poisson", "dp_poisson_unpadded", "dp_by_index", "dp_in_graph"):
    configs[f"fit_{kind}"] = _fit_config(name, kind, 1, a.batch, a.steps)
  if a.configs:
    keep = a.configs.split(",")
    configs = {k: v for k, v in configs.items() if k in keep}
  sec = _fit_rounds(configs, a.epochs)
  ms = {k: 1e3 * v / a.steps for k, v in sec.items()}
  if a.configs:      # the fit configurations only
    return {"model": name, "ms_per_step": {k: round(v, 3) for k, v in ms.items()},
            "ledger_steps": {k: int(m.ledger.sample_count.numpy())
                             for k, (m, _) in configs.items() if k.startswith("fit_dp")}}
  ledger_steps = {k: int(m.ledger.sample_count.numpy()) for k, (m, _) in configs.items()
                  if k.startswith("fit_dp")}
  fns = _functions(name, a.batch, configs["fit_dp_spe1"][0])
  calls = a.steps * a.epochs
  for k, fn in fns.items():
    ms[k] = 1e3 * _median_call(fn, calls)
  ms = {k: round(v, 3) for k, v in ms.items()}
  r = lambda u, v: round(ms[u] / ms[v], 3)
  return {"model": name, "ms_per_step": ms, "ratios": {
      "fit_dp/fit_nonprivate spe1": r("fit_dp_spe1", "fit_nonprivate_spe1"),
      "fit_dp/fit_nonprivate spe8": r("fit_dp_spe8", "fit_nonprivate_spe8"),
      "fit_dp/fit_nonprivate spe32": r("fit_dp_spe32", "fit_nonprivate_spe32"),
      "fit_dp_poisson/fit_nonprivate spe1": r("fit_dp_poisson", "fit_nonprivate_spe1"),
      "fit_dp_poisson/fit_dp_spe1": r("fit_dp_poisson", "fit_dp_spe1"),
      "fit_dp_poisson_unpadded/fit_dp_poisson": r("fit_dp_poisson_unpadded", "fit_dp_poisson"),
      "fit_dp_by_index/fit_dp_poisson": r("fit_dp_by_index", "fit_dp_poisson"),
      "bare_fast/bare_nonprivate": r("bare_fast", "bare_nonprivate"),
      "fit_dp_spe1/bare_fast": r("fit_dp_spe1", "bare_fast"),
      "fit_dp_spe32/bare_fast": r("fit_dp_spe32", "bare_fast"),
      "fit_nonprivate_spe1/bare_nonprivate": r("fit_nonprivate_spe1", "bare_nonprivate")},
      "ledger_steps": ledger_steps,        # one sample per step whatever steps_per_execution
      "ledger_steps_expected": a.steps * (a.epochs + 1)}


def main():
  warnings.simplefilter("ignore")
  out = {"batch": ARGS.batch, "epochs": ARGS.epochs, "steps": ARGS.steps,
         "onednn": ARGS.onednn, "tf": tf.__version__, "cpus": os.cpu_count(),
         "load_avg_start": os.getloadavg(), "results": []}
  for name in ARGS.models.split(","):
    out["results"].append(profile(name, ARGS))
  out["load_avg_end"] = os.getloadavg()
  print(json.dumps(out))


if __name__ == "__main__":
  main()
