"""TF Privacy's Keras MNIST tutorial (a plain keras.Sequential CNN, DPKerasSGDOptimizer with
microbatches, an unreduced loss, `model.fit`), written for tf_dpiter.

The one changed line against TF Privacy's tutorial is `model = dp.keras.make_private(model)`:
in Keras 3 the private step lives in the model's `train_step`, so a plain `keras.Sequential`
compiled with a DP optimizer is refused at its first step with a message naming
`make_private`. Everything else is TF Privacy's code with `tensorflow_privacy` spelled `dp`.

What changes in the numbers: with `num_microbatches` tf_dpiter's `fit` cuts shuffled passes
(removing an example would re-deal the others among microbatches, so Poisson sampling is
refused); a pass costs one un-amplified Gaussian mechanism under replace-one adjacency
(sensitivity 2C). TF Privacy's `compute_dp_sgd_privacy(n, batch_size, noise_multiplier,
epochs, delta)` assumes Poisson sampling, so the number it prints is not this run's; the script
prints it beside the run's own statement (`model.privacy_statement(delta)`, from the ledger),
which says so. Privacy claim: (epsilon, delta)-DP for replacing one example.

  python tutorials/mnist_keras_sequential.py --quick      # 2000 examples, 1 epoch
  python tutorials/mnist_keras_sequential.py              # TF Privacy's 60 epochs (hours on 2 cores)

The last line printed is JSON: {"test_accuracy", "epsilon", "delta", "steps", ...}.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tf_dpiter as dp  # noqa: E402  (was: import tensorflow_privacy)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data_path", default=dp.data.default_mnist_path())
  p.add_argument("--quick", action="store_true", help="1 epoch on 2000 training examples")
  p.add_argument("--learning_rate", type=float, default=0.15)
  p.add_argument("--noise_multiplier", type=float, default=1.1)
  p.add_argument("--l2_norm_clip", type=float, default=1.0)
  p.add_argument("--batch_size", type=int, default=250)
  p.add_argument("--epochs", type=int, default=60)
  p.add_argument("--microbatches", type=int, default=250)
  p.add_argument("--delta", type=float, default=1e-5)
  args = p.parse_args(argv)
  train_size, test_size = (2000, 500) if args.quick else (None, None)
  if args.quick:
    args.epochs, args.batch_size, args.microbatches, args.learning_rate = 1, 100, 100, 0.25
  if args.batch_size % args.microbatches != 0:
    raise ValueError("batch_size must be a multiple of microbatches")
  train_data, train_labels, test_data, test_labels = dp.data.load_mnist(
      args.data_path, train_size, test_size)

  model = keras.Sequential(dp.keras.example_models.mnist_cnn_layers())   # TF Privacy's CNN
  model = dp.keras.make_private(model)   # the one changed line (Keras 3: the step is the model's)

  optimizer = dp.keras.DPKerasSGDOptimizer(
      l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
      num_microbatches=args.microbatches, learning_rate=args.learning_rate)
  # per-example losses, as TF Privacy asks (reduction NONE)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
  model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
  model.fit(train_data, train_labels, epochs=args.epochs,
            validation_data=(test_data, test_labels), batch_size=args.batch_size, verbose=2)
  _, accuracy = model.evaluate(test_data, test_labels, batch_size=500, verbose=0)

  # TF Privacy's closing lines: epsilon from the hyperparameters (assumes Poisson sampling) ...
  eps, _ = dp.accounting.compute_dp_sgd_privacy(len(train_data), args.batch_size,
                                                args.noise_multiplier, args.epochs,
                                                args.delta)
  print(f"compute_dp_sgd_privacy(...) (assumes Poisson sampling): epsilon = {eps:.3f}")
  # ... and the run's own statement, from its ledger: the number to report
  statement = model.privacy_statement(args.delta)
  print(statement)
  print(f"test accuracy {accuracy:.4f}, epsilon {statement.epsilon:.4g} at delta {args.delta:g}")
  print(json.dumps({
      "test_accuracy": round(float(accuracy), 4), "epsilon": statement.epsilon,
      "delta": args.delta, "steps": statement.steps, "passes": statement.passes,
      "sampling": statement.policy, "noise_multiplier": args.noise_multiplier,
      "batch_size": args.batch_size, "train_size": len(train_data),
      "epsilon_if_poisson": statement.epsilon_if_poisson}))


if __name__ == "__main__":
  main()
