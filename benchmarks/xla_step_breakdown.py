"""Where the DP step's time goes under XLA on CPU, against the non-private step (issue 25).

  python benchmarks/xla_step_breakdown.py [--models cnn,mlp,transformer,lstm] [--batch 256]
      [--transformer_batch 64] [--calls 20] [--rounds 3] [--onednn 1]

For each model (those of benchmarks/fit_step_time.py: the tutorial CNN, the MLP, the
Transformer encoder, the LSTM language model) one process builds a non-private Keras model
and a DP model (DPKerasSGDOptimizer(1.0, 1.1), the default clipping), both compiled with
jit_compile=True, on ONE fixed batch of B examples (weight 1; the DP sampling declared with
set_sampling, Poisson q = B / 60000), and times, round robin (every component --calls calls
per round, --rounds rounds after a warm-up; figure: the median over rounds of the mean wall
ms per call):

  nonprivate_step   the non-private model's whole Keras train function (XLA, one program:
                    forward, backward, SGD update, metrics)
  dp_step           the DP model's whole train function (the XLA clipped sum, then the
                    noise, the ledger append and the update)
  backward          one forward + backward pass of the mean loss, alone (XLA): what "one
                    backward pass" costs, the reference of the fast path
  clipped_sum       the DP step's compiled program alone (per-example norms + clipped sum,
                    and the noise when it is drawn inside): `model._dp_core_fn`
  noise_tf          the Gaussian draw alone on the model's shapes, TensorFlow's kernel
                    (outside XLA, how CPU steps draw it)
  noise_xla         the same draw inside XLA (stateless Philox, noise_draw.noised_sum)
  noise_xla_auto    the same with tf.random.stateless_normal's default alg="auto_select"
                    (what noise_draw used before it named "philox")
  noise_ledger      `PrivateStep.noised_average` on a zero sum: noise + ledger append + query
                    state, as the DP train step calls it after the program
  update            the SGD update alone (apply_private_gradients, not compiled)

Derived: clipping_over_backward = clipped_sum / backward (the fast path's cost in backward
passes); the gap dp_step - nonprivate_step and its parts. Prints one JSON object per model
(and the load average), all figures from one process.
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import fit_step_time   # benchmarks/ (the script's directory): the same models and data

def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default="cnn,mlp,transformer,lstm")
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--transformer_batch", type=int, default=64,
                 help="batch of the Transformer and the LSTM")
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--onednn", default="1")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _components(name, a):
  """{component: zero-argument callable} for one model (each runs one call)."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  from tf_dpiter.keras.optimizer import noise_draw  # pylint: disable=g-import-not-at-top
  xs, ys, b = fit_step_time.dataset(name, a)
  x, y = xs[:b], ys[:b]
  w = np.ones(b, "float32")
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  keras.utils.set_random_seed(0)
  plain = fit_step_time.build_model(name, False)
  plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=True)
  keras.utils.set_random_seed(0)
  private = fit_step_time.build_model(name, True)
  private.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                  loss=loss, jit_compile=True)
  opt = private.optimizer
  step = opt.private_step
  opt.set_sampling(fit_step_time.N_POP, b / fit_step_time.N_POP, "poisson", b)
  plain_ds = tf.data.Dataset.from_tensors((x, y)).repeat()
  dp_ds = tf.data.Dataset.from_tensors((x, y, w)).repeat()
  plain.fit(plain_ds, steps_per_epoch=1, epochs=1, verbose=0)
  private.fit(dp_ds, steps_per_epoch=1, epochs=1, verbose=0)
  plain_it, dp_it = iter(plain_ds), iter(dp_ds)
  xt, yt, wt = tf.constant(x), tf.constant(y), tf.constant(w)
  variables = private.trainable_variables
  shapes = [v.shape for v in variables]

  @tf.function(jit_compile=True)
  def backward():
    with tf.GradientTape() as tape:
      l = loss(yt, private(xt, training=True))
    return tape.gradient(l, variables)

  zeros = [tf.zeros(s) for s in shapes]
  stddev = step.stddev

  @tf.function
  def noise_tf():
    return [z + tf.random.normal(z.shape, stddev=stddev) for z in zeros]

  @tf.function(jit_compile=True)
  def noise_xla(seed):
    return noise_draw.noised_sum(zeros, stddev, seed)

  seed = tf.constant([1, 2], tf.int64)

  @tf.function(jit_compile=True)
  def noise_xla_auto(seed):
    n = int(sum(np.prod(s) for s in shapes))
    return tf.random.stateless_normal([n], seed=seed) * stddev

  @tf.function
  def noise_ledger():
    return step.noised_average(zeros, tf.constant(float(b)))

  @tf.function
  def update():
    return opt.apply_private_gradients(zeros, variables)

  core = private._dp_core_fn  # pylint: disable=protected-access
  params = step.sample_params()
  info = {"clipping": step.resolve_clipping(private), "noise_in_program":
          bool(getattr(private, "_dp_noise_inside", False)), "batch": b,
          "parameters": int(sum(np.prod(s) for s in shapes))}
  return info, {
      "nonprivate_step": lambda: plain.train_function(plain_it),
      "dp_step": lambda: private.train_function(dp_it),
      "backward": backward,
      "clipped_sum": lambda: core(xt, yt, wt, params),
      "noise_tf": noise_tf,
      "noise_xla": lambda: noise_xla(seed),
      "noise_xla_auto": lambda: noise_xla_auto(seed),
      "noise_ledger": noise_ledger,
      "update": update,
  }, private


def _sync(out):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  for t in tf.nest.flatten(out):
    if hasattr(t, "numpy"):
      t.numpy()


def _time(fns, calls, rounds):
  for f in fns.values():   # warm-up: tracing and compilation
    for _ in range(2):
      _sync(f())
  per = {k: [] for k in fns}
  for _ in range(rounds):
    for k, f in fns.items():
      t0 = time.perf_counter()
      for _ in range(calls):
        out = f()
      _sync(out)
      per[k].append(1e3 * (time.perf_counter() - t0) / calls)
  return {k: round(statistics.median(v), 3) for k, v in per.items()}


def _child(a):
  warnings.simplefilter("ignore")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  for name in a.models.split(","):
    load0 = os.getloadavg()
    info, fns, private = _components(name, a)
    t = _time(fns, a.calls, a.rounds)
    gap = t["dp_step"] - t["nonprivate_step"]
    print(json.dumps({
        "model": name, **info, "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        "tf": tf.__version__, "ms": t,
        "dp_over_nonprivate": round(t["dp_step"] / t["nonprivate_step"], 3),
        "clipping_over_backward": round(t["clipped_sum"] / t["backward"], 3),
        "gap_ms": round(gap, 3),
        "ledger_samples": int(private.optimizer.ledger.sample_count.numpy()),
        "load_avg": [load0, os.getloadavg()]}), flush=True)


def main():
  a = _parse()
  if a.child:
    _child(a)
    return
  fit_step_time.run_children(__file__, sys.argv[1:], a.onednn)


if __name__ == "__main__":
  main()
