"""Where a Poisson batch's cost in the DP `fit` step goes, against a fixed batch (issue 42).

  TF_ENABLE_ONEDNN_OPTS=1 python benchmarks/poisson_step_ablation.py [--model cnn]
      [--batch 256] [--steps 32] [--rounds 7] [--configs a,b,...] [--profile a,b --top 40]

One process; each configuration is one DP model (fit_step_time.py's, clip 1.0, noise 1.1),
fit for one epoch of --steps steps per round, round robin, after a warm-up epoch. The data
walk from a fixed batch to fit's own Poisson samples one difference at a time:
  dp_fixed_batch      one fixed batch of B rows, static shape [B, ...] (the trace knows B)
  dp_fixed_dynamic    the same rows, the batch dimension unknown to the trace (rows [:s] of
                      constants, s = B from a dataset): the step's graph as dp_spe1's
  dp_fixed_sizes      the first s rows, s cycling over 64 Poisson sizes (Binomial(n, q))
  dp_poisson_in_graph 64 Poisson samples' indices drawn ahead (numpy), cycled and gathered
                      in the graph (Dataset.range + map: one tf.data function, no Python)
  dp_poisson_dataset  dp.data.poisson_batches(x, y, B, max_batch_size=None, endless=True),
                      built once and given to every fit (a fresh sample each step; indices
                      drawn in Python, INDEX_CHUNK steps per call)
  dp_graph_sampler    data.graph_sampling.poisson_batches_in_graph(x, y, B, max_batch_size=None):
                      the library's in-graph Poisson sampler (n float64 uniforms a step)
  dp_spe1             fit(x, y, batch_size=B): the default (arrays_to_dataset each fit)
  nonprivate_spe1     Keras' own fit, for the ratio
(the ledger is told the fixed configurations' sampling with optimizer.set_sampling: what is
timed is the step, not a guarantee). Figures, medians over rounds: CPU ms per step over the
epoch (process CPU time / steps, the epoch start included, as fit_step_time.py), steady ms
(median interval between steps inside the epoch), epoch start CPU ms (epoch begin to the
end of its first step, which creates the epoch's tf.data iterator), and each dataset's
iterator start alone (CPU ms of `iter(dataset)`, 9 times). --epochs_per_fit E > 1: each
fit runs E epochs and its first is not timed (what a fit of many epochs pays per step: fit on
arrays keeps one iterator for all its epochs; fit_step_time.py's figure is one fit per epoch,
each paying the pipeline's start). --profile: the per-op table
(fit_op_profile.py's) of one epoch of each named configuration instead of the timing.
Prints one JSON line.
"""

import argparse
import json
import os
import statistics
import time
import warnings


CONFIGS = ("nonprivate_spe1,dp_fixed_batch,dp_fixed_dynamic,dp_fixed_sizes,"
           "dp_poisson_in_graph,dp_poisson_dataset,dp_spe1")


def _parse():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--epochs_per_fit", type=int, default=1,
                 help="epochs of each fit call; above 1 each fit's first epoch is not timed")
  p.add_argument("--configs", default=CONFIGS)
  p.add_argument("--profile", default="", help="configurations to profile, comma-separated")
  p.add_argument("--top", type=int, default=40)
  return p.parse_args()


def _configs(a):
  """{name: (model, fit kwargs)} of the module docstring."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  from tf_dpiter.data import graph_sampling  # pylint: disable=g-import-not-at-top
  from tf_dpiter.data import sampling  # pylint: disable=g-import-not-at-top
  import fit_step_time  # pylint: disable=g-import-not-at-top
  fa = fit_step_time._parse(["--steps", str(a.steps), "--spe", "1", "--extra",  # pylint: disable=protected-access
                             "--batch", str(a.batch)])
  base = fit_step_time._configs(a.model, fa)  # pylint: disable=protected-access
  xs, ys, b = fit_step_time.dataset(a.model, fa)
  n, steps = xs.shape[0], a.steps

  def dp_model(declare=True):
    keras.utils.set_random_seed(0)
    m = fit_step_time.build_model(a.model, True)
    m.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if declare:
      m.optimizer.set_sampling(n, b / n, "poisson", b)
    return m

  options = sampling.PIPELINE_OPTIONS
  xc, yc = tf.constant(xs), tf.constant(ys)
  rng = np.random.default_rng(1)
  draws = [sampling.poisson_indices(rng, 0, n, b / n) for _ in range(64)]
  sizes = tf.constant([len(d) for d in draws], tf.int32)
  longest = max(len(d) for d in draws)
  table = tf.constant(np.stack([np.pad(d, (0, longest - len(d))) for d in draws]))
  first_rows = tf.constant(np.tile(np.arange(longest), (64, 1)))

  def cycled(indices):   # step t: the rows indices[t % 64][:sizes[t % 64]], gathered
    def rows(t):
      idx = indices[t % 64][:sizes[t % 64]]
      return tf.gather(xc, idx), tf.gather(yc, idx), tf.ones(tf.shape(idx), tf.float32)
    return tf.data.Dataset.range(2 ** 62).map(rows, num_parallel_calls=2).prefetch(2).with_options(
        options)

  fixed_dynamic = tf.data.Dataset.from_tensors(np.int32(b)).repeat().map(
      lambda s: (xc[:s], yc[:s], tf.ones([s]))).prefetch(2).with_options(options)
  out = {k: base[k] for k in ("nonprivate_spe1", "dp_fixed_batch", "dp_spe1")}
  out["dp_fixed_dynamic"] = (dp_model(), dict(x=fixed_dynamic))
  out["dp_fixed_sizes"] = (dp_model(), dict(x=cycled(first_rows)))
  out["dp_poisson_in_graph"] = (dp_model(), dict(x=cycled(table)))
  out["dp_poisson_dataset"] = (dp_model(declare=False), dict(x=dp.data.poisson_batches(
      xs, ys, b, steps_per_epoch=steps, max_batch_size=None, endless=True)))
  out["dp_graph_sampler"] = (dp_model(declare=False), dict(
      x=graph_sampling.poisson_batches_in_graph(xs, ys, b, steps_per_epoch=steps,
                                                max_batch_size=None)))
  for name in ("dp_fixed_dynamic", "dp_fixed_sizes", "dp_poisson_in_graph", "dp_poisson_dataset",
               "dp_graph_sampler"):
    out[name][1]["steps_per_epoch"] = steps
    assert out[name][1]["x"].element_spec[0].shape[0] is None, name
  return {k: out[k] for k in a.configs.split(",")}


def _time(configs, rounds, steps, epochs=1):
  """{name: {cpu, steady, epoch_start}} medians over rounds (and timed epochs), in ms; with
  epochs > 1 each fit runs that many epochs and its first (the fit's own start) is not timed."""
  import keras  # pylint: disable=g-import-not-at-top

  class Timer(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.cpu, self.steady, self.start = [], [], []

    def on_epoch_begin(self, epoch, logs=None):
      self._c, self._last, self._on = time.process_time(), None, epoch > 0 or epochs == 1

    def on_train_batch_end(self, batch, logs=None):
      now = time.perf_counter()
      if not self._on:
        return
      if batch == 0:
        self.start.append(time.process_time() - self._c)
      if self._last is not None:
        self.steady.append((now - self._last) / (batch - self._last_batch))
      self._last, self._last_batch = now, batch

    def on_epoch_end(self, epoch, logs=None):
      if self._on:
        self.cpu.append(time.process_time() - self._c)

  timers = {k: Timer() for k in configs}
  for m, kw in configs.values():
    m.fit(**kw, epochs=1, verbose=0)
  for _ in range(rounds):
    for k, (m, kw) in configs.items():
      m.fit(**kw, epochs=epochs, verbose=0, callbacks=[timers[k]])
  med = lambda v, d=1: round(1e3 * statistics.median(v) / d, 3)
  return {k: {"cpu": med(t.cpu, steps), "steady": med(t.steady), "epoch_start": med(t.start)}
          for k, t in timers.items()}


def _iterator_start(configs):
  """{name: median CPU ms of iter(dataset)} for the configurations fit on a dataset."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = {}
  for k, (_, kw) in configs.items():
    if isinstance(kw.get("x"), tf.data.Dataset):
      cpu = []
      for _ in range(9):
        c = time.process_time()
        it = iter(kw["x"])
        cpu.append(time.process_time() - c)
        del it
      out[k] = round(1e3 * statistics.median(cpu), 2)
  return out


def _profile(configs, a):
  """One JSON line per profiled configuration: its top ops and op counts per step."""
  import fit_op_profile  # pylint: disable=g-import-not-at-top
  for name in a.profile.split(","):
    ops = fit_op_profile.profile_epoch(*configs[name], a.steps, 10 ** 6)
    print(json.dumps({"config": name, "ops_per_step": round(sum(o[3] for o in ops), 1),
                      "self_ms_per_step": round(sum(o[2] for o in ops if o[0] != "IDLE"), 3),
                      "ops": ops[:a.top]}), flush=True)


def main():
  a = _parse()
  warnings.simplefilter("ignore")
  configs = _configs(a)
  if a.profile:
    _profile(configs, a)
    return
  out = {"model": a.model, "batch": a.batch, "steps": a.steps, "rounds": a.rounds,
         "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
         "start_utc": time.strftime("%H:%M:%S", time.gmtime()), "load_avg_start": os.getloadavg()}
  out["epochs_per_fit"] = a.epochs_per_fit
  out["ms"] = _time(configs, a.rounds, a.steps, a.epochs_per_fit)
  out["iterator_start_cpu_ms"] = _iterator_start(configs)
  out["load_avg_end"] = os.getloadavg()
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
