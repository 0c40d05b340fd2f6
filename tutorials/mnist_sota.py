"""MNIST at epsilon <= 3 with ScatterNet features and DP-SGD.

The recipe of Tramer and Boneh, "Differentially Private Learning Needs Better Features (or
Much More Data)", ICLR 2021, Sections 3-4, through tf_dpiter's public API:

  1. features: the scattering transform (`dp.keras.layers.Scattering2D`, J = 2, L = 8: 81
     channels at 7 x 7), then a group normalization of each example's own 81 channels
     (27 groups, no learned scale: `keras.layers.GroupNormalization`; Tramer and Boneh
     normalize with privately computed BatchNorm statistics instead). Both are fixed
     functions of one example, computed once before training: no privacy cost.
  2. model: a linear classifier on the 7 x 7 x 81 features (their ScatterNet + linear;
     `--model cnn` for a small tanh CNN on them), trained with DP-SGD with their published
     MNIST hyperparameters: momentum 0.9, clipping norm 0.1, learning rate 8, expected batch
     4096, 40 epochs (`dp.keras.from_budget` calibrates the noise to --epsilon for the steps
     fit takes), Poisson sampling (the DP model's fit default on arrays).
  3. optional weight averaging (`--ema_decay`, `dp.keras.callbacks.ExponentialMovingAverage`):
     post-processing of the released iterates, no privacy cost; the model evaluated is then
     the average.

Privacy: add/remove one training example (unit: one example of the training split), Poisson
sampling; epsilon is computed from the model's own privacy ledger (RDP accountant) at
--delta, and the last JSON line prints it. The default hyperparameters are Tramer and Boneh's
published ones, fixed before this code looked at the data (they chose them on MNIST
themselves, outside any accounting, as the DP literature's published settings are): no
selection on this run's data is in or missing from its epsilon. The validation split
(--validation_size examples held out of the training set, never trained on) serves
--eval_on validation and --private_tuning; the test set is only used for the final figure.

--private_tuning chooses the learning rate privately and charges it (Papernot and Steinke,
"Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022, Theorem 2): K trials, K
drawn from a truncated negative binomial fixed in advance (--tuning_mean, --tuning_shape;
default mean 3, logarithmic), each a full run of the recipe with a learning rate drawn
uniformly from --tuning_learning_rates and scored by its validation accuracy as a noisy count
(Gaussian, stddev --score_noise examples, recorded in the trial's ledger: the validation
examples are protected too); the best trial's model is released as it is (no retraining,
which would be another charge). The training noise is calibrated so that the whole selection
has epsilon <= --epsilon, and the epsilon printed is the selected trial's ledger with its
selection record (dp-accounting's RepeatAndSelectDpEvent). The guarantee covers the released
model and its score only: K, the other trials' scores (--report_trials, diagnostics) and the
run time are not covered (nor the ledger file's selection record, which states K).

  python tutorials/mnist_sota.py --quick                  # smoke run (2,000 examples, 2 epochs)
  python tutorials/mnist_sota.py --seed 0                 # epsilon 3 (the default recipe)
  python tutorials/mnist_sota.py --epsilon 1 --seed 0
  python tutorials/mnist_sota.py --eval_on validation ... # for choosing hyperparameters
  python tutorials/mnist_sota.py --private_tuning --seed 0 # selection charged: epsilon 3 in all

The last line printed is JSON: {"accuracy", "eval_on", "epsilon", "delta", "steps", ...}.

Measured (2 shared CPU cores under load 3-8, 55,000 training examples, delta 1e-5): test
accuracy 98.61 % (6 seeds, 98.52-98.68 %) at epsilon 2.9998, about 1 minute a run (features
cached); 97.60 % (3 seeds, 97.46-97.73 %) at epsilon 1. With the learning rate chosen
privately (--private_tuning, epsilon 3 in all, each trial at epsilon 2.07): 98.48 % (6
seeds, 98.34-98.56 %), 1 to 3 minutes a run.
"""

import argparse
import gc
import hashlib
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dpiter as dp  # noqa: E402  (pip install -e . : see README)
from tf_dpiter.keras.callbacks.averaging import ExponentialMovingAverage  # noqa: E402
from tf_dpiter.keras.layers import Scattering2D  # noqa: E402

def feature_extractor(shape=(28, 28), group_norm=True):
  """Scattering (J = 2, L = 8) then per-example group normalization; no weights, no data."""
  layers = [keras.Input(shape), Scattering2D(J=2, L=8)]
  if group_norm:
    layers.append(
        keras.layers.GroupNormalization(groups=27, center=False, scale=False, epsilon=1e-5))
  return keras.Sequential(layers)


def features(x, cache_dir, group_norm=True, batch=1000):
  """The extractor's output on x, computed once (XLA, in batches) and cached by content."""
  key = hashlib.sha256(x.tobytes()).hexdigest()[:16]
  name = f"scattering_J2_L8_{'gn27' if group_norm else 'raw'}_{key}.npy"
  path = os.path.join(cache_dir, name) if cache_dir else None
  if path and os.path.exists(path):
    return np.load(path)
  extractor = feature_extractor(x.shape[1:], group_norm)
  run = tf.function(lambda b: extractor(b, training=False), jit_compile=True)
  out = []
  for i in range(0, len(x), batch):
    chunk = x[i:i + batch]
    pad = batch - len(chunk)   # one static shape: a single XLA compilation
    res = run(tf.constant(np.concatenate([chunk, np.zeros((pad,) + chunk.shape[1:], "float32")])
                          if pad else chunk)).numpy()
    out.append(res[:len(chunk)])
  out = np.concatenate(out)
  if path:
    os.makedirs(cache_dir, exist_ok=True)
    np.save(path, out)
  return out


def make_model(kind, shape, width):
  """The classifier on scattering features: a tanh CNN (Tramer and Boneh's ScatterNet+CNN,
  smaller) or a linear model (their ScatterNet+linear); or the raw-pixel baseline."""
  L = keras.layers
  if kind == "pixels_cnn":     # the baseline: TF Privacy's tutorial CNN on raw pixels
    return dp.keras.DPSequential(dp.keras.example_models.mnist_cnn_layers())
  if kind == "linear":
    layers = [keras.Input(shape), L.Flatten(), L.Dense(10)]
  else:
    layers = [keras.Input(shape),
              L.Conv2D(width, 3, padding="same", activation="tanh"),
              L.MaxPooling2D(2),
              L.Conv2D(2 * width, 3, padding="same", activation="tanh"),
              L.Flatten(), L.Dense(10)]
  return dp.keras.DPSequential(layers)


def split(x, y, validation_size, seed=12345):
  """A fixed split of the training set (the same for every run seed)."""
  order = np.random.RandomState(seed).permutation(len(x))
  val, train = order[:validation_size], order[validation_size:]
  return x[train], y[train], x[val], y[val]


def parse(argv):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data_path", default=dp.data.default_mnist_path())
  p.add_argument("--cache_dir", default="/tmp/tf_dpiter_features",
                 help="where the scattering features are cached ('' for no cache)")
  p.add_argument("--quick", action="store_true",
                 help="smoke run: 2,000 training examples, 2 epochs")
  p.add_argument("--epsilon", type=float, default=3.0, help="target epsilon (from_budget)")
  p.add_argument("--delta", type=float, default=1e-5)
  p.add_argument("--epochs", type=int, default=40)
  p.add_argument("--batch_size", type=int, default=4096, help="expected batch size (Poisson)")
  p.add_argument("--l2_norm_clip", type=float, default=0.1)
  p.add_argument("--learning_rate", type=float, default=8.0)
  p.add_argument("--momentum", type=float, default=0.9)
  p.add_argument("--model", choices=["cnn", "linear", "pixels_cnn"], default="linear",
                 help="cnn / linear on scattering features; pixels_cnn: plain DP-SGD "
                      "baseline, TF Privacy's tutorial CNN on raw pixels (no features)")
  p.add_argument("--width", type=int, default=16, help="channels of the CNN's first conv")
  p.add_argument("--ema_decay", type=float, default=0.0,
                 help="EMA of the weights evaluated at the end (0: no averaging)")
  p.add_argument("--no_group_norm", dest="group_norm", action="store_false",
                 help="ablation: raw scattering features (no per-example group norm)")
  p.add_argument("--validation_size", type=int, default=5000)
  p.add_argument("--eval_on", choices=["test", "validation"], default="test")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--jit", action="store_true", help="jit_compile=True (XLA) for training")
  p.add_argument("--verbose", type=int, default=0)
  g = p.add_argument_group("private selection of the learning rate (Papernot and Steinke)")
  g.add_argument("--private_tuning", action="store_true",
                 help="choose the learning rate by a private random search on the validation "
                      "split, charged in epsilon (the ledger's selection record)")
  g.add_argument("--tuning_learning_rates", default="4,8,16",
                 help="the candidates, drawn uniformly for each trial")
  g.add_argument("--tuning_mean", type=float, default=3.0, help="E[K], the mean number of trials")
  g.add_argument("--tuning_shape", type=float, default=0.0,
                 help="shape of K's truncated negative binomial (0: logarithmic; inf: Poisson)")
  g.add_argument("--score_noise", type=float, default=10.0,
                 help="noise stddev (in examples) of each trial's validation count")
  g.add_argument("--tuning_seed", type=int, default=None,
                 help="tests only: a reproducible number of trials is not private")
  g.add_argument("--report_trials", action="store_true",
                 help="diagnostics: also print K and every trial's noisy score, which the "
                      "guarantee does NOT cover (only the best trial's output is released)")
  return p.parse_args(argv)


def plan(args, n):
  """(epochs, expected batch, steps) of one training run on n examples."""
  epochs = 2 if args.quick else args.epochs
  batch = min(args.batch_size, n // 4)
  # fit's Poisson epochs take round(n / B) steps each
  return epochs, batch, epochs * max(1, round(n / batch))


def train(args, ftr, ytr, learning_rate, noise_multiplier=None):
  """One DP-SGD run of the recipe; (model, optimizer). Without `noise_multiplier`, the noise
  is calibrated to --epsilon by `from_budget` for the steps fit takes."""
  epochs, batch, steps = plan(args, len(ftr))
  if noise_multiplier is None:
    # from_budget plans ceil(E n / B) steps, so it is given the epochs that make its plan
    # the steps fit takes (or one more: epsilon then stays below the target)
    sgd = keras.optimizers.SGD(learning_rate, momentum=args.momentum)
    opt = dp.keras.from_budget(sgd, epsilon=args.epsilon, delta=args.delta,
                               epochs=steps * batch / len(ftr), batch_size=batch,
                               population_size=len(ftr), l2_norm_clip=args.l2_norm_clip)
  else:
    opt = dp.keras.DPKerasSGDOptimizer(l2_norm_clip=args.l2_norm_clip,
                                       noise_multiplier=noise_multiplier,
                                       learning_rate=learning_rate, momentum=args.momentum)
  model = make_model(args.model, ftr.shape[1:], args.width)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                weighted_metrics=["accuracy"], jit_compile=args.jit)
  callbacks = [ExponentialMovingAverage(decay=args.ema_decay)] if args.ema_decay else []
  model.fit(ftr, ytr, batch_size=batch, epochs=epochs, callbacks=callbacks,
            verbose=args.verbose)
  return model, opt


def summary(args, n, acc, epsilon, run, t0, t_feat, **extra):
  """The JSON line the tutorial ends with (`run`: steps, noise_multiplier, learning_rate)."""
  epochs, batch, _ = plan(args, n)
  out = {
      "accuracy": round(float(acc), 4), "eval_on": args.eval_on,
      "epsilon": float(epsilon), "target_epsilon": args.epsilon, "delta": args.delta,
      "steps": run["steps"], "epochs": epochs, "population": n, "batch_size": batch,
      "noise_multiplier": run["noise_multiplier"], "l2_norm_clip": args.l2_norm_clip,
      "learning_rate": run["learning_rate"], "momentum": args.momentum, "model": args.model,
      "width": args.width, "ema_decay": args.ema_decay, "group_norm": args.group_norm,
      "seed": args.seed}
  out.update(extra)
  out.update({"feature_seconds": round(t_feat, 1), "seconds": round(time.time() - t0, 1)})
  return json.dumps(out)


def predict(model, x):
  """The predicted classes of x."""
  return np.argmax(model.predict(x, batch_size=1000, verbose=0), -1)


def ledger_arrays(ledger):
  """(samples, queries, passes) of a ledger: what the accountant reads, without the model."""
  passes = ledger.passes
  return ledger.get_arrays() + (int(passes.numpy() if hasattr(passes, "numpy") else passes),)


def tune(args, ftr, ytr, fval, yval, fte, yte, t0, t_feat):
  """Private random search over --tuning_learning_rates; releases the best trial's model.

  Papernot and Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022,
  Theorem 2: K ~ truncated negative binomial (--tuning_shape, mean --tuning_mean) trials, each
  a full DP-SGD run of the recipe (same noise, steps and sampling: one mechanism) followed by
  its validation accuracy as a noisy count (`dp.tuning.noisy_count`, recorded in the trial's
  ledger); the trial with the best noisy score is released as it is (its EMA model, no
  retraining). The training noise is calibrated so that the whole selection has epsilon <=
  --epsilon (`dp.tuning.trial_noise_multiplier`); the epsilon printed is the selected trial's
  ledger with its selection record (`dp.tuning.RandomSearch` -> `selection_report`).
  """
  _, batch, steps = plan(args, len(ftr))
  z = dp.tuning.trial_noise_multiplier(args.epsilon, args.delta, batch / len(ftr), steps,
                                       args.tuning_mean, args.tuning_shape, args.score_noise)
  rates = [float(r) for r in args.tuning_learning_rates.split(",")]
  trials = []

  def trial(learning_rate):
    model, opt = train(args, ftr, ytr, learning_rate, noise_multiplier=z)
    correct = int(np.sum(predict(model, fval) == yval))
    score = dp.tuning.noisy_count(model.ledger, correct, len(fval), args.score_noise)
    trials.append({"learning_rate": learning_rate,
                   "noisy_validation_accuracy": round(score / len(fval), 4)})
    kept = {"weights": model.get_weights(), "ledger": ledger_arrays(model.ledger),
            "run": {"steps": int(model.ledger.sample_count.numpy()) - 1,  # last: the score
                    "noise_multiplier": float(opt.noise_multiplier),
                    "learning_rate": learning_rate}}
    del model, opt
    keras.backend.clear_session()   # the trial's graphs and data copies: K runs in one process
    gc.collect()
    return score, kept, kept["ledger"]

  search = dp.tuning.RandomSearch(args.tuning_mean, args.tuning_shape, seed=args.tuning_seed)
  rate, result, score, report = search.run(
      lambda rng: rates[int(rng.integers(len(rates)))], trial, args.delta)
  if result is None:      # K = 0 (Poisson only): nothing trained, nothing released
    print(json.dumps({"accuracy": None, "epsilon": 0.0, "private_tuning": True, "trials": 0}))
    return
  model = make_model(args.model, fte.shape[1:], args.width)
  model.set_weights(result["weights"])          # the selected trial's (EMA) weights
  acc = float(np.mean(predict(model, fte) == yte))
  trial_eps = dp.accounting.privacy_report(result["ledger"], delta=args.delta).epsilon
  print(f"test accuracy {acc:.4f} of the selected trial (learning rate {rate}); "
        f"epsilon {report.epsilon:.5f} including the selection (one trial: {trial_eps:.5f})")
  extra = {"private_tuning": True, "selected_learning_rate": rate,
           "noisy_validation_accuracy": round(score / len(fval), 4),
           "tuning_mean": args.tuning_mean, "tuning_shape": args.tuning_shape,
           "candidates": rates, "score_noise": args.score_noise, "validation_size": len(fval),
           "trial_epsilon": float(trial_eps)}
  if args.report_trials:
    extra.update({"trials": len(trials), "trial_scores": trials})
  print(summary(args, len(ftr), acc, report.epsilon, result["run"], t0, t_feat, **extra))


def main(argv=None):
  args = parse(argv)
  t0 = time.time()
  keras.utils.set_random_seed(args.seed)
  xtr, ytr, xte, yte = dp.data.load_mnist(args.data_path)
  xtr, xte = xtr[..., 0], xte[..., 0]   # [n, 28, 28]: the scattering input
  xtr, ytr, xval, yval = split(xtr, ytr, args.validation_size)
  if args.quick:
    xtr, ytr = xtr[:2000], ytr[:2000]
  cache = args.cache_dir or None
  if args.private_tuning and args.eval_on == "validation":
    raise SystemExit("--private_tuning scores the trials on the validation split and evaluates "
                     "the selected one on the test set: drop --eval_on validation")
  xev, yev = (xval, yval) if args.eval_on == "validation" else (xte, yte)
  if args.model == "pixels_cnn":
    ftr, fev, fval = xtr[..., None], xev[..., None], xval[..., None]
  else:
    ftr, fev = features(xtr, cache, args.group_norm), features(xev, cache, args.group_norm)
    fval = features(xval, cache, args.group_norm) if args.private_tuning else None
  t_feat = time.time() - t0
  if args.private_tuning:
    return tune(args, ftr, ytr, fval, yval, fev, yev, t0, t_feat)
  model, opt = train(args, ftr, ytr, args.learning_rate)
  _, acc = model.evaluate(fev, yev, batch_size=1000, verbose=0)
  report = dp.accounting.privacy_report(model.ledger, delta=args.delta)
  print(f"{args.eval_on} accuracy {acc:.4f}; {report}")
  run = {"steps": int(model.ledger.sample_count.numpy()),
         "noise_multiplier": float(opt.noise_multiplier), "learning_rate": args.learning_rate}
  print(summary(args, len(ftr), acc, report.epsilon, run, t0, t_feat))


if __name__ == "__main__":
  main()
