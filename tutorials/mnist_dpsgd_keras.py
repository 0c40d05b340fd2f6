"""DP-SGD on MNIST with Keras 3 and tf_dpiter (McMahan et al. 2018, Section 7; Abadi et al. 2016).

The CNN of TF Privacy's MNIST tutorial, trained with TF Privacy's idiom
`model.fit(x, y, batch_size=256)`: on arrays, tf_dpiter's fit draws Poisson samples of
expected size 256 (q = 256 / 60000), so the ledger's Poisson accounting is true; every step
goes to the privacy ledger, and epsilon is computed from the ledger (RDP accountant).
`--sampling shuffle` trains on shuffled passes instead (replace-one, no amplification:
epsilon is much larger; the PrivacyMeter also logs what Poisson would have cost).

  python tutorials/mnist_dpsgd_keras.py --quick                 # 2 epochs, a few minutes on 2 cores
  python tutorials/mnist_dpsgd_keras.py --epochs 60             # clip 1.0, noise 1.1, lr 0.15
  python tutorials/mnist_dpsgd_keras.py --epochs 45 --noise_multiplier 0.7 --l2_norm_clip 1.5 --learning_rate 0.25

The last line printed is JSON: {"test_accuracy", "epsilon", "delta", "epochs", "seconds", ...}.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TF's oneDNN CPU kernels are off by default on CPUs without AVX-512 VNNI; on for this CNN
# they made both the private and the non-private step ~3x faster (BENCHMARKS.md).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import keras  # noqa: E402

import tf_dpiter as dp  # noqa: E402  (pip install -e . : see README)
from tf_dpiter.auditing import sensitivity  # noqa: E402

def make_cnn():
  """TF Privacy's MNIST tutorial CNN: conv 16x8x8/2, pool, conv 32x4x4/2, pool, dense 32, 10."""
  return dp.keras.DPSequential(dp.keras.example_models.mnist_cnn_layers())


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data_path", default=dp.data.default_mnist_path())
  p.add_argument("--epochs", type=int, default=60)
  p.add_argument("--quick", action="store_true", help="2 epochs (the README's main command)")
  p.add_argument("--batch_size", type=int, default=256, help="expected batch size (Poisson)")
  p.add_argument("--l2_norm_clip", type=float, default=1.0)
  p.add_argument("--noise_multiplier", type=float, default=1.1)
  p.add_argument("--learning_rate", type=float, default=0.15)
  p.add_argument("--momentum", type=float, default=0.0)
  p.add_argument("--decay", choices=["constant", "cosine"], default="constant",
                 help="learning-rate schedule: constant (TF Privacy's tutorial) or cosine decay "
                      "to 0 over the run (keras.optimizers.schedules.CosineDecay)")
  p.add_argument("--delta", type=float, default=1e-5)
  p.add_argument("--sampling", choices=["poisson", "shuffle"], default="poisson",
                 help="poisson: batch_size is the expected batch size; shuffle: passes")
  p.add_argument("--clipping", choices=list(dp.keras.CLIPPING_MODES), default="auto",
                 help="per-example clipping; 'auto' takes the ghost-norm fast path for this CNN")
  p.add_argument("--max_physical_batch_size", type=int, default=None)
  p.add_argument("--jit", action="store_true", help="jit_compile=True (XLA)")
  p.add_argument("--epsilon_budget", type=float, default=None,
                 help="stop before epsilon would exceed this (StopAtPrivacyBudget)")
  p.add_argument("--ledger_path", default=None, help="write the JSON ledger here")
  p.add_argument("--validate", action="store_true", help="evaluate on the test set every epoch")
  p.add_argument("--check_sensitivity", action="store_true",
                 help="before training, run tf_dpiter.auditing.check_sensitivity on the CNN "
                      "(always on with --quick: about 10 s on 2 cores)")
  p.add_argument("--secure_mode", action="store_true",
                 help="noise from os.urandom (GaussianSumQuery secure_mode)")
  p.add_argument("--verbose", type=int, default=2)
  args = p.parse_args(argv)
  epochs = 2 if args.quick else args.epochs

  t0 = time.time()
  xtr, ytr, xte, yte = dp.data.load_mnist(args.data_path)
  model = make_cnn()
  lr = args.learning_rate
  if args.decay == "cosine":   # over every step fit takes: shuffled passes or Poisson epochs
    per_epoch = (dp.data.steps_per_pass(len(xtr), args.batch_size) if args.sampling == "shuffle"
                 else max(1, round(len(xtr) / args.batch_size)))
    lr = keras.optimizers.schedules.CosineDecay(lr, decay_steps=epochs * per_epoch)
  opt = dp.keras.DPKerasSGDOptimizer(
      l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
      num_microbatches=None, learning_rate=lr, momentum=args.momentum,
      clipping=args.clipping, max_physical_batch_size=args.max_physical_batch_size,
      secure_mode=args.secure_mode)
  # weighted_metrics: Keras 3's `metrics` ignore sample_weight, so the Poisson batches'
  # padding rows (weight 0) would count as wrong answers (0.76 shown for a model at 0.96).
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                weighted_metrics=["accuracy"], jit_compile=args.jit)
  if args.quick or args.check_sensitivity:
    t_check = time.time()
    check = sensitivity.check_sensitivity(model, xtr[:64], ytr[:64], policy=args.sampling,
                                          num_candidates=6)
    print(f"{check}  [check_sensitivity, {time.time() - t_check:.1f} s]")
  callbacks = [dp.keras.callbacks.PrivacyMeter(delta=args.delta)]
  if args.epsilon_budget:
    callbacks.append(dp.keras.callbacks.StopAtPrivacyBudget(args.epsilon_budget, args.delta))
  if args.ledger_path:
    callbacks.append(dp.keras.callbacks.LedgerExport(args.ledger_path))
  val = (xte, yte) if args.validate else None
  hist = model.fit(xtr, ytr, batch_size=args.batch_size, epochs=epochs, sampling=args.sampling,
                   validation_data=val, callbacks=callbacks, verbose=args.verbose)
  _, acc = model.evaluate(xte, yte, batch_size=1000, verbose=0)
  report = dp.accounting.privacy_report(model.ledger, delta=args.delta)
  seconds = time.time() - t0
  print(f"test accuracy {acc:.4f}; {report}")
  print(json.dumps({
      "test_accuracy": round(float(acc), 4), "epsilon": round(float(report.epsilon), 4),
      "delta": args.delta, "epochs": len(hist.history["loss"]), "seconds": round(seconds, 1),
      "steps": int(model.ledger.sample_count.numpy()), "sampling": args.sampling,
      "batch_size": args.batch_size, "l2_norm_clip": args.l2_norm_clip,
      "noise_multiplier": args.noise_multiplier, "learning_rate": args.learning_rate,
      "decay": args.decay,
      "clipping": opt.resolve_clipping(model), "jit": args.jit}))


if __name__ == "__main__":
  main()
