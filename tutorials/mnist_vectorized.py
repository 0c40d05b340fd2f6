"""TF Privacy's `mnist_dpsgd_tutorial_vectorized.py` (a tf.estimator program with the TF1
`VectorizedDPSGD` optimizer), rewritten for tf_dpiter and Keras 3 by the migration guide's rows
(docs/migration/tf-privacy.md).

What changed against TF Privacy's file, one row of the guide each:

* the Estimator program (`cnn_model_fn` returning `EstimatorSpec`s, `numpy_input_fn`,
  `classifier.train` / `.evaluate`) -> the model_fn's layers as a Keras functional model made
  private (`dp.keras.make_private`), `compile`, `model.fit` one epoch at a time and
  `model.evaluate` (TF 2.21 has no tf.estimator);
* `dp_optimizer_vectorized.VectorizedDPSGD(l2_norm_clip, noise_multiplier, num_microbatches,
  learning_rate)` -> `dp.compat.VectorizedDPKerasSGDOptimizer`, the same arguments (per-example
  gradients by vectorization, `clipping="vectorized"`);
* its hand-written `compute_epsilon(steps)` (a dp-accounting RdpAccountant composing a Poisson
  event of q = batch_size / 60000 for epoch * 60000 // batch_size steps) -> the run's ledger,
  `model.privacy_statement(delta)`, after every epoch.

Kept: `num_microbatches = batch_size` (one example per microbatch: per-example clipping), the
vector loss, the per-epoch test accuracy and epsilon lines. `fit(x, y, batch_size=B)` draws
Poisson samples of expected size B (q = B / n), the sampling TF Privacy's accounting assumed
and `numpy_input_fn(shuffle=True)` did not do; round(n / B) steps an epoch. Privacy claim:
(epsilon, delta)-DP for adding or removing one training example, RDP accountant over the
ledger, n = len(training set) treated as public.

  python tutorials/mnist_vectorized.py --quick      # 300 examples, 2 epochs (seconds)
  python tutorials/mnist_vectorized.py              # TF Privacy's 60 epochs (hours on 2 cores)

The last line printed is JSON: {"test_accuracy", "epsilon", "delta", "steps", ...}.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tf_dpiter as dp  # noqa: E402  (was: import tensorflow_privacy)

QUICK = dict(train_size=300, test_size=100, epochs=2, batch_size=50, microbatches=50,
             learning_rate=0.25)


def parse_flags(argv):
  """TF Privacy's flags (same names and defaults), plus --quick and --data_path."""
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data_path", default=dp.data.default_mnist_path())
  p.add_argument("--quick", action="store_true",
                 help="2 epochs on 300 training examples, expected batch 50 (12 steps)")
  p.add_argument("--learning_rate", type=float, default=0.15)
  p.add_argument("--noise_multiplier", type=float, default=1.1)
  p.add_argument("--l2_norm_clip", type=float, default=1.0)
  p.add_argument("--batch_size", type=int, default=200)
  p.add_argument("--epochs", type=int, default=60)
  p.add_argument("--microbatches", type=int, default=200)
  p.add_argument("--delta", type=float, default=1e-5)
  p.add_argument("--verbose", type=int, default=0)
  args = p.parse_args(argv)
  args.train_size = args.test_size = None
  if args.quick:
    for key, value in QUICK.items():
      setattr(args, key, value)
  if args.batch_size % args.microbatches != 0:
    raise ValueError("Number of microbatches should divide evenly batch_size")
  return args


def cnn_model():
  """The CNN of TF Privacy's cnn_model_fn, as a Keras functional model (logits out)."""
  inputs = keras.Input((28, 28, 1), name="x")
  y = keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu")(inputs)
  y = keras.layers.MaxPool2D(2, 1)(y)
  y = keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu")(y)
  y = keras.layers.MaxPool2D(2, 1)(y)
  y = keras.layers.Flatten()(y)
  y = keras.layers.Dense(32, activation="relu")(y)
  logits = keras.layers.Dense(10)(y)
  return keras.Model(inputs, logits)


def main(argv=None):
  """Runs the tutorial; returns (JSON summary dict, trained model)."""
  args = parse_flags(argv)
  train_data, train_labels, test_data, test_labels = dp.data.load_mnist(
      args.data_path, args.train_size, args.test_size)

  model = dp.keras.make_private(cnn_model())   # was: the Estimator's model_fn
  optimizer = dp.compat.VectorizedDPKerasSGDOptimizer(   # was: VectorizedDPSGD
      l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
      num_microbatches=args.microbatches, learning_rate=args.learning_rate)
  # the vector loss of cnn_model_fn (sparse softmax cross entropy per example)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
  model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])

  # Training loop: one epoch, then the test accuracy and the epsilon spent so far.
  for epoch in range(1, args.epochs + 1):
    model.fit(train_data, train_labels, epochs=1, batch_size=args.batch_size,
              verbose=args.verbose)
    _, test_accuracy = model.evaluate(test_data, test_labels, batch_size=500, verbose=0)
    print(f"Test accuracy after {epoch} epochs is: {test_accuracy:.3f}")
    eps = model.privacy_statement(args.delta).epsilon   # was: compute_epsilon(steps)
    print(f"For delta={args.delta:g}, the current epsilon is: {eps:.2f}")

  statement = model.privacy_statement(args.delta)
  print(statement)
  out = {"test_accuracy": round(float(test_accuracy), 4), "epsilon": statement.epsilon,
         "delta": args.delta, "steps": statement.steps, "sampling": statement.policy,
         "relation": statement.relation, "unit": statement.unit,
         "q": statement.selection_probability, "noise_multiplier": args.noise_multiplier,
         "batch_size": args.batch_size, "microbatches": args.microbatches,
         "clipping": optimizer.clipping, "train_size": len(train_data)}
  print(json.dumps(out))
  return out, model


if __name__ == "__main__":
  main()
