"""TF Privacy's vectorized MNIST tutorial (per-example gradients by vectorization,
`VectorizedDPKerasSGDOptimizer`), written for tf_dpiter with Keras 3.

TF Privacy's vectorized optimizers compute every example's gradient with a vectorized map
(`tf.vectorized_map`); `dp.compat.VectorizedDPKerasSGDOptimizer` takes the same arguments and
is tf_dpiter's DP optimizer with `clipping="vectorized"`. The model is a plain
`keras.Sequential` made private by `dp.keras.make_private(model)` (the one added line: in
Keras 3 the private step is the model's). `num_microbatches=None` clips each example, and
`fit(x, y, batch_size=B)` draws Poisson samples (q = B / n): the run's statement
(`model.privacy_statement(delta)`) is add-or-remove-one DP with amplification by sampling.

  python tutorials/mnist_vectorized.py --quick      # 2000 examples, 1 epoch
  python tutorials/mnist_vectorized.py              # 15 epochs

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
  p.add_argument("--batch_size", type=int, default=200)
  p.add_argument("--epochs", type=int, default=15)
  p.add_argument("--delta", type=float, default=1e-5)
  args = p.parse_args(argv)
  train_size, test_size = (2000, 500) if args.quick else (None, None)
  if args.quick:
    args.epochs, args.batch_size, args.learning_rate = 1, 100, 0.25
  train_data, train_labels, test_data, test_labels = dp.data.load_mnist(
      args.data_path, train_size, test_size)

  model = keras.Sequential(dp.keras.example_models.mnist_cnn_layers())   # TF Privacy's CNN
  model = dp.keras.make_private(model)   # the one added line
  optimizer = dp.compat.VectorizedDPKerasSGDOptimizer(
      l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
      num_microbatches=None, learning_rate=args.learning_rate)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
  model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
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
      "clipping": optimizer.clipping, "train_size": len(train_data)}))


if __name__ == "__main__":
  main()
