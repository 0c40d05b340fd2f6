"""TF Privacy's MNIST logistic-regression tutorial (mnist_lr), written for tf_dpiter and Keras 3.

Multinomial logistic regression (one dense layer of 10 logits on the 784 pixels, an L2 weight
penalty) trained with DP-SGD: each example's gradient clipped to l2_norm_clip, Gaussian noise
of standard deviation noise_multiplier * l2_norm_clip added to their sum once per batch. A
convex model makes a useful baseline: DP-SGD gets within a few points of the non-private
accuracy at moderate epsilon. The model is a plain `keras.Sequential` made private by
`dp.keras.make_private(model)` (the one added line); `fit(x, y, batch_size=B)` draws Poisson
samples (q = B / n), and epsilon is the run's, from its ledger
(`model.privacy_statement(delta)`): (epsilon, delta)-DP for adding or removing one example.
The weight penalty is a function of the weights only (no example's data), so it is added to
every example's loss without changing the sensitivity.

  python tutorials/mnist_lr.py --quick      # 2000 examples, 2 epochs
  python tutorials/mnist_lr.py              # 60000 examples, 20 epochs (minutes on 2 cores)

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
  p.add_argument("--quick", action="store_true", help="2 epochs on 2000 training examples")
  p.add_argument("--learning_rate", type=float, default=1.0)
  p.add_argument("--noise_multiplier", type=float, default=1.1)
  p.add_argument("--l2_norm_clip", type=float, default=1.0)
  p.add_argument("--batch_size", type=int, default=256)
  p.add_argument("--epochs", type=int, default=20)
  p.add_argument("--regularizer", type=float, default=1e-5, help="L2 weight penalty")
  p.add_argument("--delta", type=float, default=1e-5)
  args = p.parse_args(argv)
  train_size, test_size = (2000, 500) if args.quick else (None, None)
  if args.quick:
    args.epochs, args.batch_size = 2, 100
  train_data, train_labels, test_data, test_labels = dp.data.load_mnist(
      args.data_path, train_size, test_size)

  model = keras.Sequential([
      keras.Input((28, 28, 1)),
      keras.layers.Flatten(),
      keras.layers.Dense(10, kernel_regularizer=keras.regularizers.L2(args.regularizer)),
  ])
  model = dp.keras.make_private(model)   # the one added line
  optimizer = dp.keras.DPKerasSGDOptimizer(
      l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
      num_microbatches=None, learning_rate=args.learning_rate)
  model.compile(optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
  model.fit(train_data, train_labels, epochs=args.epochs, batch_size=args.batch_size,
            verbose=2)
  _, accuracy = model.evaluate(test_data, test_labels, batch_size=500, verbose=0)

  statement = model.privacy_statement(args.delta)   # from the ledger of the steps taken
  print(statement)
  print(f"test accuracy {accuracy:.4f}, epsilon {statement.epsilon:.4g} at delta {args.delta:g}")
  print(json.dumps({
      "test_accuracy": round(float(accuracy), 4), "epsilon": statement.epsilon,
      "delta": args.delta, "steps": statement.steps, "sampling": statement.policy,
      "q": statement.selection_probability, "noise_multiplier": args.noise_multiplier,
      "train_size": len(train_data)}))


if __name__ == "__main__":
  main()
