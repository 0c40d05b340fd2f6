"""Where the DP step's time goes under XLA on CPU, against the non-private step (issue 25).

  python benchmarks/xla_step_breakdown.py [--models cnn,mlp,transformer,lstm] [--batch 256]
      [--transformer_batch 64] [--calls 20] [--rounds 3] [--onednn 1]

For each model (those of benchmarks/fit_step_time.py: the tutorial CNN, the MLP, the
Transformer encoder, the LSTM language model) one process builds a non-private Keras model
and three DP models (DPKerasSGDOptimizer(1.0, 1.1), the default clipping), all compiled with
jit_compile=True, the DP sampling declared with set_sampling (Poisson q = B / 60000), each
on ONE fixed batch: B examples of weight 1, or (padded) the B examples then zero rows of
weight 0 up to data.sampling.default_max_batch_size(60000, q) (E + 4 sd, what fit pads a
Poisson sample to under XLA; B real records is the median sample), and times, round robin (every component --calls calls
per round, --rounds rounds after a warm-up; figure: the median over rounds of the mean wall
ms per call):

  nonprivate_step   the non-private model's whole Keras train function (XLA, one program:
                    forward, backward, SGD update, metrics)
  dp_step           the DP model's whole train function (the XLA clipped sum, then the
                    noise, the ledger append and the update), B examples
  dp_step_padded    the same on the padded batch (the all-padding tail skipped,
                    chunking.chunk_layout)
  dp_step_padded_whole  the same with `private_step.set_flags(skip_padding_tail=False)`: every
                    padding row computed (before the tail was skipped)
  backward          one forward + backward pass of the mean loss, alone (XLA): what "one
                    backward pass" costs, the reference of the fast path
  clipped_sum       the DP step's compiled program alone (per-example norms + clipped sum,
                    and the noise when it is drawn inside): `model._dp_core_fn`; and
                    clipped_sum_padded, clipped_sum_padded_whole: on the padded batch
  noise_tf          the Gaussian draw alone on the model's shapes, TensorFlow's kernel
                    (outside XLA, how CPU steps draw it)
  noise_xla         the same draw inside XLA: the Gaussian query's own get_noised_result (its
                    Philox generator), as a jit_compile=True step on an accelerator runs it
  noise_xla_stateless  a stateless Philox draw of the same size inside XLA (the compiled draw
                    before it became the query's own; for comparison only)
  noise_ledger      `PrivateStep.noised_average` on a zero sum: noise + ledger append + query
                    state, as the DP train step calls it after the program
  update            the SGD update alone (apply_private_gradients, not compiled)

Derived: clipping_over_backward = clipped_sum / backward (the fast path's cost in backward
passes); padded_skip_over_whole = dp_step_padded / dp_step_padded_whole; the gap
dp_step - nonprivate_step. Prints one JSON object per model
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


def _dp_model(name, loss, b, x, y, w, skip=True):
  """A DP model (DPKerasSGDOptimizer(1.0, 1.1), jit_compile=True, Poisson q = b / n
  declared), trained one step on the fixed batch (x, y, w); returns (model, iterator)."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  model = fit_step_time.build_model(name, True)
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=loss, jit_compile=True)
  model.optimizer.private_step.set_flags(skip_padding_tail=skip)
  model.optimizer.set_sampling(fit_step_time.N_POP, b / fit_step_time.N_POP, "poisson", b)
  ds = tf.data.Dataset.from_tensors((x, y, w)).repeat()
  model.fit(ds, steps_per_epoch=1, epochs=1, verbose=0)
  return model, iter(ds)


def _noise_fns(step, shapes, b):
  """The noise components: TensorFlow's kernel, the query's draw under XLA, a stateless draw
  under XLA, with the ledger."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  zeros = [tf.zeros(s) for s in shapes]
  stddev, seed = step.stddev, tf.constant([1, 2], tf.int64)
  size = int(sum(np.prod(s) for s in shapes))
  noise_tf = tf.function(lambda: [z + tf.random.normal(z.shape, stddev=stddev) for z in zeros])
  query, state = step.require_query().query, step.global_state()
  noise_xla = tf.function(lambda: query.get_noised_result(zeros, state)[0], jit_compile=True)
  stateless = tf.function(lambda s: tf.random.stateless_normal([size], seed=s, alg="philox")
                          * stddev, jit_compile=True)
  ledger = tf.function(lambda: step.noised_average(zeros, tf.constant(float(b))))
  return {"noise_tf": noise_tf, "noise_xla": noise_xla,
          "noise_xla_stateless": lambda: stateless(seed), "noise_ledger": ledger}


def _components(name, a):
  """(info, {component: zero-argument callable}, DP models) for one model."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_dpiter as dp  # pylint: disable=g-import-not-at-top
  xs, ys, b = fit_step_time.dataset(name, a)
  x, y, w = xs[:b], ys[:b], np.ones(b, "float32")
  pad = dp.data.sampling.default_max_batch_size(fit_step_time.N_POP, b / fit_step_time.N_POP)
  xp, yp, wp = xs[:pad].copy(), ys[:pad].copy(), np.zeros(pad, "float32")
  xp[b:], yp[b:], wp[:b] = 0, 0, 1.0      # b real records (the expected size), then padding
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  keras.utils.set_random_seed(0)
  plain = fit_step_time.build_model(name, False)
  plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=True)
  plain_ds = tf.data.Dataset.from_tensors((x, y)).repeat()
  plain.fit(plain_ds, steps_per_epoch=1, epochs=1, verbose=0)
  plain_it = iter(plain_ds)
  private, dp_it = _dp_model(name, loss, b, x, y, w)
  padded, pad_it = _dp_model(name, loss, b, xp, yp, wp)
  whole, whole_it = _dp_model(name, loss, b, xp, yp, wp, skip=False)
  step, variables = private.optimizer.private_step, private.trainable_variables
  xt, yt, wt = tf.constant(x), tf.constant(y), tf.constant(w)
  pad_args = [tf.constant(t) for t in (xp, yp, wp)]

  @tf.function(jit_compile=True)
  def backward():
    with tf.GradientTape() as tape:
      l = loss(yt, private(xt, training=True))
    return tape.gradient(l, variables)

  core = lambda m, *args: m._dp_core_fn(*args, m.optimizer.private_step.sample_params())  # pylint: disable=protected-access
  zeros = [tf.zeros(v.shape) for v in variables]
  info = {"clipping": step.resolve_clipping(private), "noise_in_program":
          bool(getattr(private, "_dp_noise_inside", False)), "batch": b, "padded_to": pad,
          "parameters": int(sum(np.prod(v.shape) for v in variables))}
  return info, {
      "nonprivate_step": lambda: plain.train_function(plain_it),
      "dp_step": lambda: private.train_function(dp_it),
      "dp_step_padded": lambda: padded.train_function(pad_it),
      "dp_step_padded_whole": lambda: whole.train_function(whole_it),
      "backward": backward,
      "clipped_sum": lambda: core(private, xt, yt, wt),
      "clipped_sum_padded": lambda: core(padded, *pad_args),
      "clipped_sum_padded_whole": lambda: core(whole, *pad_args),
      **_noise_fns(step, [v.shape for v in variables], b),
      "update": tf.function(lambda: private.optimizer.apply_private_gradients(zeros, variables)),
  }, (private, padded, whole)


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
    info, fns, models = _components(name, a)
    t = _time(fns, a.calls, a.rounds)
    gap = t["dp_step"] - t["nonprivate_step"]
    print(json.dumps({
        "model": name, **info, "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        "tf": tf.__version__, "ms": t,
        "dp_over_nonprivate": round(t["dp_step"] / t["nonprivate_step"], 3),
        "clipping_over_backward": round(t["clipped_sum"] / t["backward"], 3),
        "gap_ms": round(gap, 3),
        "padded_skip_over_whole": round(t["dp_step_padded"] / t["dp_step_padded_whole"], 3),
        "ledger_samples": [int(m.optimizer.ledger.sample_count.numpy()) for m in models],
        "load_avg": [load0, os.getloadavg()]}), flush=True)


def main():
  a = _parse()
  if a.child:
    _child(a)
    return
  fit_step_time.run_children(__file__, sys.argv[1:], a.onednn)


if __name__ == "__main__":
  main()
