"""TF Privacy's `mnist_dpsgd_tutorial_keras_model.py`, rewritten for tf_dpiter by the
migration guide's rows (docs/migration/tf-privacy.md): the DP settings given to the model
(`DPSequential(l2_norm_clip, noise_multiplier, num_microbatches, layers)`), compiled with a plain
Keras SGD, trained by `model.fit`.

What changed against TF Privacy's file, one row of the guide each:

* `from tensorflow_privacy... import DPSequential` -> `dp.compat.DPSequential`, the same
  arguments (no other changed line: at `compile` the plain SGD becomes its DP copy with the
  model's settings).
* its hand-written `compute_epsilon(steps)` (a dp-accounting RdpAccountant composing a
  Poisson event of q = batch_size / 60000 for epochs * 60000 // batch_size steps) ->
  `model.privacy_statement(delta)`, the run's own ledger.

Kept as TF Privacy wrote it: `num_microbatches = batch_size` (one example per microbatch),
`validation_data`. One example per microbatch is per-example clipping, so `fit` draws Poisson
samples of expected size B (q = B / n), the sampling TF Privacy's accounting assumed, and the
epsilon printed is the run's. Privacy claim: (epsilon, delta)-DP for adding or removing one
training example, RDP accountant over the ledger, n = len(training set) treated as public.
The noise multiplier defaults to 1.1 (TF Privacy's README table; its file's flag now says 0.1,
an epsilon in the hundreds).

  python tutorials/mnist_keras_model.py --quick      # 500 examples, 1 epoch (seconds)
  python tutorials/mnist_keras_model.py              # TF Privacy's 60 epochs (hours on 2 cores)

The last line printed is JSON: {"test_accuracy", "epsilon", "delta", "steps", ...}.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tf_dpiter as dp  # noqa: E402  (was: import tensorflow_privacy)

QUICK = dict(train_size=500, test_size=100, epochs=1, batch_size=50, microbatches=50,
             learning_rate=0.25)


def parse_flags(argv, batch_size=250, epochs=60):
  """TF Privacy's flags (same names and defaults, noise 1.1), plus --quick and --data_path."""
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data_path", default=dp.data.default_mnist_path())
  p.add_argument("--quick", action="store_true",
                 help="1 epoch on 500 training examples, expected batch 50 (10 steps)")
  p.add_argument("--learning_rate", type=float, default=0.15)
  p.add_argument("--noise_multiplier", type=float, default=1.1)
  p.add_argument("--l2_norm_clip", type=float, default=1.0)
  p.add_argument("--batch_size", type=int, default=batch_size)
  p.add_argument("--epochs", type=int, default=epochs)
  p.add_argument("--microbatches", type=int, default=batch_size)
  p.add_argument("--delta", type=float, default=1e-5)
  p.add_argument("--verbose", type=int, default=2)
  args = p.parse_args(argv)
  args.train_size = args.test_size = None
  if args.quick:
    for key, value in QUICK.items():
      setattr(args, key, value)
  if args.batch_size % args.microbatches != 0:
    raise ValueError("Number of microbatches should divide evenly batch_size")
  return args


def load_mnist(args):
  """TF Privacy's load_mnist: images in [0, 1] of shape [28, 28, 1], one-hot labels."""
  train_data, train_labels, test_data, test_labels = dp.data.load_mnist(
      args.data_path, args.train_size, args.test_size)
  return (train_data, keras.utils.to_categorical(train_labels, 10), test_data,
          keras.utils.to_categorical(test_labels, 10))


def report(model, args, accuracy, train_size, **extra):
  """Prints TF Privacy's closing line with the ledger's epsilon, the run's statement and the
  JSON summary; returns the summary (a dict)."""
  statement = model.privacy_statement(args.delta)   # was: compute_epsilon(steps)
  print(f"For delta={args.delta:g}, the current epsilon is: {statement.epsilon:.2f}")
  print(statement)
  out = {"test_accuracy": round(float(accuracy), 4), "epsilon": statement.epsilon,
         "delta": args.delta, "steps": statement.steps, "sampling": statement.policy,
         "relation": statement.relation, "unit": statement.unit,
         "q": statement.selection_probability, "noise_multiplier": args.noise_multiplier,
         "batch_size": args.batch_size, "microbatches": args.microbatches,
         "train_size": train_size, **extra}
  print(json.dumps(out))
  return out


def main(argv=None):
  """Runs the tutorial; returns (JSON summary dict, trained model)."""
  args = parse_flags(argv)
  train_data, train_labels, test_data, test_labels = load_mnist(args)

  layers = [
      keras.Input((28, 28, 1)),
      keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
      keras.layers.MaxPool2D(2, 1),
      keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
      keras.layers.MaxPool2D(2, 1),
      keras.layers.Flatten(),
      keras.layers.Dense(32, activation="relu"),
      keras.layers.Dense(10),
  ]
  model = dp.compat.DPSequential(   # was: tensorflow_privacy's DPSequential
      l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
      num_microbatches=args.microbatches, layers=layers)

  optimizer = keras.optimizers.SGD(learning_rate=args.learning_rate)
  loss = keras.losses.CategoricalCrossentropy(from_logits=True)
  model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
  model.fit(train_data, train_labels, epochs=args.epochs,
            validation_data=(test_data, test_labels), batch_size=args.batch_size,
            verbose=args.verbose)
  _, accuracy = model.evaluate(test_data, test_labels, batch_size=500, verbose=0)
  return report(model, args, accuracy, len(train_data)), model


if __name__ == "__main__":
  main()
