"""`model.fit` step time, DP against non-private, the way a user calls it (issue 18).

  python benchmarks/fit_step_time.py [--models cnn,mlp,transformer,lstm] [--batch 256]
      [--steps 64] [--rounds 5] [--spe 1,8] [--onednn 0,1] [--extra] [--jit 0|1]
      [--compare_tail]

--jit 1 compiles every configuration with jit_compile=True (XLA, what Keras picks by itself
on a GPU/TPU machine): DP and non-private both under XLA. The LSTM language model
(Embedding 2000 x 64, LSTM 128 with return_sequences, Dense 2000 logits per token, 40 tokens,
per-token loss) uses batch --transformer_batch.

For each oneDNN setting (TF_ENABLE_ONEDNN_OPTS, read when TensorFlow loads, so each setting
is one child process) and each model, these fit configurations are timed round robin in ONE
process (every configuration one epoch of --steps steps per round, --rounds rounds after a
warm-up epoch; figure: median over rounds of epoch wall time / steps, and of the process CPU
time / steps, and the steady ms/step: the median interval between consecutive steps inside
an epoch, which excludes each epoch's start — what long epochs cost per step):
  nonprivate_spe{k}   keras.Sequential + SGD, fit(x, y, batch_size=B): Keras' own shuffled
                      batches from the arrays, steps_per_execution k
  dp_spe{k}           DPSequential + DPKerasSGDOptimizer (clip 1.0, noise 1.1, the default
                      clipping: fast), fit(x, y, batch_size=B): Poisson samples (q = B / n,
                      unpadded without XLA), one ledger sample per step, steps_per_execution k
with --compare_tail (under --jit 1; steps_per_execution 1), the step before the padded tail
was skipped, in the same process, alternated with the others:
  dp_whole_padding    dp_spe1 with `optimizer.private_step.set_flags(skip_padding_tail=False)`: every
                      padding row of the padded Poisson sample computed (chunking.chunk_layout)
and with --extra (steps_per_execution 1):
  dp_padded           fit on dp.data.poisson_batches(..., max_batch_size="auto") (padded to
                      default_max_batch_size, as XLA needs)
  dp_fixed_batch      DP fit on one fixed batch of B (repeated; sampling declared by
                      set_sampling): the DP step without any sampling
  nonprivate_fixed_batch
Data: n = 60000 random MNIST-shaped records (28x28x1 for the CNN, 784 for the MLP); for the
Transformer (`example_models.transformer_encoder`: Embedding 10k x 128, 2 blocks of 4-head
attention + LayerNorm + Dense 256/128, mean-pooled, 2 classes; 1.6M parameters) n = 60000
random token sequences of 128 ids with binary labels, batch --transformer_batch (64). The
ledger's sample count is checked against the steps taken (exact with any spe). Prints one
JSON object per oneDNN setting.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

N_POP = 60000


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default="cnn,mlp")
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--transformer_batch", type=int, default=64)
  p.add_argument("--steps", type=int, default=64, help="steps per epoch (a multiple of spe)")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--spe", default="1,8", help="steps_per_execution values")
  p.add_argument("--onednn", default="0,1", help="TF_ENABLE_ONEDNN_OPTS values, one process each")
  p.add_argument("--extra", action="store_true", help="padded / fixed-batch configurations")
  p.add_argument("--jit", type=int, default=0, help="1: compile(jit_compile=True) (XLA)")
  p.add_argument("--compare_tail", action="store_true",
                 help="add dp_whole_padding (skip_padding_tail=False)")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def dataset(name, a):
  """(xs, ys, batch) of the n = 60000 random records of model `name` (module docstring)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  if name == "transformer":
    return (rng.randint(0, 10000, (N_POP, 128)).astype("int32"),
            rng.randint(0, 2, N_POP).astype("int32"), a.transformer_batch)
  if name == "lstm":
    return (rng.randint(0, 2000, (N_POP, 40)).astype("int32"),
            rng.randint(0, 2000, (N_POP, 40)).astype("int32"), a.transformer_batch)
  xs = rng.rand(N_POP, *((28, 28, 1) if name == "cnn" else (784,))).astype("float32")
  return xs, rng.randint(0, 10, N_POP).astype("int32"), a.batch


def build_model(name, private):
  """The uncompiled model `name` (cnn, mlp, transformer, lstm); a DP model if private."""
  import keras  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  ex = dp.keras.example_models
  if name == "transformer":
    net = ex.transformer_encoder()
    return (dp.keras.DPModel if private else keras.Model)(net.inputs, net.outputs)
  if name == "lstm":
    layers = [keras.Input((40,), dtype="int32"), keras.layers.Embedding(2000, 64),
              keras.layers.LSTM(128, return_sequences=True), keras.layers.Dense(2000)]
  else:
    layers = ex.mnist_cnn_layers() if name == "cnn" else ex.mlp_layers()
  return (dp.keras.DPSequential if private else keras.Sequential)(layers)


def _configs(name, a):
  """{config name: (model, fit kwargs)} for one model."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  xs, ys, b = dataset(name, a)
  steps = a.steps
  build = lambda private: build_model(name, private)

  def model(private, spe=1):
    keras.utils.set_random_seed(0)
    if not private:
      m = build(False)
      m.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, steps_per_execution=spe,
                jit_compile=bool(a.jit))
      return m
    m = build(True)
    m.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1), loss=loss,
              steps_per_execution=spe, jit_compile=bool(a.jit))
    return m

  out = {}
  for spe in (int(k) for k in a.spe.split(",")):
    for private in (False, True):
      out[f"{'dp' if private else 'nonprivate'}_spe{spe}"] = (model(private, spe), dict(
          x=xs, y=ys, batch_size=b, steps_per_epoch=steps))
  if a.compare_tail:
    whole = model(True)
    whole.optimizer.private_step.set_flags(skip_padding_tail=False)
    out["dp_whole_padding"] = (whole, dict(x=xs, y=ys, batch_size=b, steps_per_epoch=steps))
  if a.extra:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      out["dp_padded"] = (model(True), dict(x=dp.data.poisson_batches(
          xs, ys, b, steps_per_epoch=steps, max_batch_size="auto")))
    fixed = model(True)
    fixed.optimizer.set_sampling(N_POP, b / N_POP, "poisson", b)
    out["dp_fixed_batch"] = (fixed, dict(x=tf.data.Dataset.from_tensors(
        (xs[:b], ys[:b], np.ones(b, "float32"))).repeat(), steps_per_epoch=steps))
    out["nonprivate_fixed_batch"] = (model(False), dict(x=tf.data.Dataset.from_tensors(
        (xs[:b], ys[:b])).repeat(), steps_per_epoch=steps))
  return out


def _time_round_robin(configs, rounds, steps):
  """{name: (median wall ms/step, median CPU ms/step, median steady ms/step)}.

  Wall and CPU: per epoch (one per round), so each epoch's start (a new iterator, the first
  step) is included; steady: the median interval between consecutive steps inside an epoch,
  what a long epoch costs per step.
  """
  import keras  # pylint: disable=g-import-not-at-top

  class EpochTimer(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.wall, self.cpu, self.steady = [], [], []

    def on_epoch_begin(self, epoch, logs=None):
      self._t, self._c = time.perf_counter(), time.process_time()
      self._last = None

    def on_train_batch_end(self, batch, logs=None):
      now = time.perf_counter()       # called once per execution (steps_per_execution)
      if self._last is not None and batch > self._last[1]:
        self.steady.append((now - self._last[0]) / (batch - self._last[1]))
      self._last = (now, batch)

    def on_epoch_end(self, epoch, logs=None):
      self.wall.append(time.perf_counter() - self._t)
      self.cpu.append(time.process_time() - self._c)

  timers = {k: EpochTimer() for k in configs}
  for m, kw in configs.values():            # warm-up: tracing, first steps
    m.fit(**kw, epochs=1, verbose=0)
  for _ in range(rounds):
    for k, (m, kw) in configs.items():
      m.fit(**kw, epochs=1, verbose=0, callbacks=[timers[k]])
  ms = lambda ts: round(1e3 * statistics.median(ts) / steps, 3)
  return {k: (ms(t.wall), ms(t.cpu), round(1e3 * statistics.median(t.steady), 3))
          for k, t in timers.items()}


def _child(a):
  warnings.simplefilter("ignore")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = {"onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"), "jit": a.jit, "batch": a.batch,
         "steps": a.steps, "rounds": a.rounds, "tf": tf.__version__, "cpus": os.cpu_count(),
         "load_avg_start": os.getloadavg(), "results": []}
  for name in a.models.split(","):
    configs = _configs(name, a)
    t = _time_round_robin(configs, a.rounds, a.steps)
    res = {"model": name,
           "batch": a.transformer_batch if name in ("transformer", "lstm") else a.batch,
           "wall_ms_per_step": {k: v[0] for k, v in t.items()},
           "cpu_ms_per_step": {k: v[1] for k, v in t.items()},
           "steady_ms_per_step": {k: v[2] for k, v in t.items()}, "ratios_wall": {},
           "ratios_cpu": {}, "ratios_steady": {},
           "ledger_samples": {k: int(m.ledger.sample_count.numpy())
                              for k, (m, _) in configs.items() if k.startswith("dp")},
           "ledger_samples_expected": a.steps * (a.rounds + 1)}
    for k in t:
      if k.startswith("dp_spe") or k == "dp_whole_padding":
        base = "nonprivate_spe1" if k == "dp_whole_padding" else "nonprivate_" + k[len("dp_"):]
        res["ratios_wall"][k] = round(t[k][0] / t[base][0], 3)
        res["ratios_cpu"][k] = round(t[k][1] / t[base][1], 3)
        res["ratios_steady"][k] = round(t[k][2] / t[base][2], 3)
    out["results"].append(res)
  out["load_avg_end"] = os.getloadavg()
  print(json.dumps(out), flush=True)


def run_children(script, argv, onednn):
  """Runs `script --child argv` once per setting of `onednn` ("0,1": TF_ENABLE_ONEDNN_OPTS is
  read when TensorFlow loads, so each setting is its own process)."""
  for setting in onednn.split(","):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=setting, TF_CPP_MIN_LOG_LEVEL="3")
    subprocess.run([sys.executable, os.path.abspath(script), "--child"] + list(argv), env=env,
                   check=True)


def main():
  a = _parse()
  if a.child:
    _child(a)
    return
  run_children(__file__, sys.argv[1:], a.onednn)


if __name__ == "__main__":
  main()
