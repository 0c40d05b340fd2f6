"""TF Privacy's Keras-model MNIST tutorial (the DP settings given to the model, a plain Keras
optimizer), written for tf_dpiter with a functional model, `keras.Model(inputs, outputs)`.

TF Privacy's idiom `DPModel = make_dp_model_class(keras.Model)` then
`DPModel(l2_norm_clip, noise_multiplier, num_microbatches, inputs=..., outputs=...)` and
`compile(optimizer=keras.optimizers.SGD(...))` runs unchanged apart from the import: at
`compile` the plain optimizer becomes its DP copy with these settings. Without microbatches
`fit(x, y, batch_size=B)` draws Poisson samples of expected size B (q = B / n), so TF
Privacy's `compute_dp_sgd_privacy` (which assumes them) and the run's own statement
(`model.privacy_statement(delta)`, from the ledger) agree. Privacy claim: (epsilon,
delta)-DP for adding or removing one example.

  python tutorials/mnist_keras_functional.py --quick      # 2000 examples, 1 epoch
  python tutorials/mnist_keras_functional.py              # 60 epochs (hours on 2 cores)

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
  p.add_argument("--delta", type=float, default=1e-5)
  args = p.parse_args(argv)
  train_size, test_size = (2000, 500) if args.quick else (None, None)
  if args.quick:
    args.epochs, args.batch_size, args.learning_rate = 1, 100, 0.25
  train_data, train_labels, test_data, test_labels = dp.data.load_mnist(
      args.data_path, train_size, test_size)

  inputs = keras.Input((28, 28, 1))
  h = keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu")(inputs)
  h = keras.layers.MaxPool2D(2, 1)(h)
  h = keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu")(h)
  h = keras.layers.MaxPool2D(2, 1)(h)
  h = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(h))
  outputs = keras.layers.Dense(10)(h)

  DPModel = dp.compat.make_dp_model_class(keras.Model)   # was: tensorflow_privacy's
  model = DPModel(l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
                  num_microbatches=None, inputs=inputs, outputs=outputs)
  model.compile(optimizer=keras.optimizers.SGD(learning_rate=args.learning_rate),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
  model.fit(train_data, train_labels, epochs=args.epochs,
            validation_data=(test_data, test_labels), batch_size=args.batch_size, verbose=2)
  _, accuracy = model.evaluate(test_data, test_labels, batch_size=500, verbose=0)

  eps, _ = dp.accounting.compute_dp_sgd_privacy(len(train_data), args.batch_size,
                                                args.noise_multiplier, args.epochs,
                                                args.delta)
  print(f"compute_dp_sgd_privacy(...) (assumes Poisson sampling): epsilon = {eps:.3f}")
  statement = model.privacy_statement(args.delta)   # the run's own, from its ledger
  print(statement)
  print(f"test accuracy {accuracy:.4f}, epsilon {statement.epsilon:.4g} at delta {args.delta:g}")
  print(json.dumps({
      "test_accuracy": round(float(accuracy), 4), "epsilon": statement.epsilon,
      "delta": args.delta, "steps": statement.steps, "sampling": statement.policy,
      "q": statement.selection_probability, "noise_multiplier": args.noise_multiplier,
      "batch_size": args.batch_size, "train_size": len(train_data),
      "epsilon_tf_privacy_call": float(eps)}))


if __name__ == "__main__":
  main()
