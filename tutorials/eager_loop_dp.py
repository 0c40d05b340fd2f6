"""DP-SGD in a custom training loop (port of TF Privacy's eager-mode MNIST tutorial).

TF Privacy's `mnist_dpsgd_tutorial_eager.py` computes per-example losses under a
GradientTape and hands them to a DP optimizer. With tf_dpiter the loop asks the optimizer
for the noised average of clipped per-record gradients (`compute_private_gradients`) and
applies it with `apply_private_gradients` (plain `apply_gradients` is refused: it would apply
gradients that never went through clipping and noise). The batches are Poisson samples
(`dp.data.poisson_batches`); the optimizer is told so with `set_sampling`, so every step goes
to its privacy ledger, and epsilon is read from the ledger (RDP accountant, dp-accounting).

The data are synthetic (no download): 10 classes of 8x8 images, each class a fixed random
pattern plus pixel noise, so accuracy well above chance is reachable in a few epochs.
Privacy claim: (epsilon, delta)-DP for adding or removing one example (Poisson sampling).

  python tutorials/eager_loop_dp.py --quick        # about half a minute on 2 cores
  python tutorials/eager_loop_dp.py --epochs 20

The last line printed is JSON: {"test_accuracy", "epsilon", "delta", "steps", ...}.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dpiter as dp  # noqa: E402  (pip install -e . : see README)


def synthetic_images(n, seed, num_classes=10, noise=0.6):
  """n images [8, 8, 1] in [0, 1]-ish: a class pattern plus Gaussian pixel noise."""
  patterns = np.random.RandomState(1234).rand(num_classes, 8, 8, 1).astype("float32")
  rng = np.random.RandomState(seed)
  y = rng.randint(0, num_classes, n).astype("int32")
  x = patterns[y] + noise * rng.randn(n, 8, 8, 1).astype("float32")
  return x, y


def make_model():
  """A small network (flatten, dense 64 relu, 10 logits): the tutorial's CNN shrunk to the
  8x8 synthetic images, so that the quick run stays well under a minute on 2 cores."""
  return keras.Sequential([
      keras.Input((8, 8, 1)),
      keras.layers.Flatten(),
      keras.layers.Dense(64, activation="relu"),
      keras.layers.Dense(10),
  ])


def train(args):
  x, y = synthetic_images(args.train_size, seed=0)
  x_test, y_test = synthetic_images(args.test_size, seed=1)
  model = make_model()
  optimizer = dp.keras.DPKerasSGDOptimizer(
      l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
      learning_rate=args.learning_rate)
  data = dp.data.poisson_batches(x, y, expected_batch_size=args.batch_size)
  spec = dp.data.get_sampling_spec(data)
  optimizer.set_sampling(spec.population_size, spec.selection_probability, spec.policy,
                         spec.sample_size)
  per_example_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                reduction=None)

  def record_loss(record):
    """Losses of one record's examples (one example here: no microbatches)."""
    rx, ry = record
    return per_example_loss(ry, model(rx, training=True))

  @tf.function
  def step(bx, by, mask):
    grads = optimizer.compute_private_gradients(record_loss, model.trainable_variables,
                                                data=(bx, by), mask=mask, model=model)
    optimizer.apply_private_gradients(grads, model.trainable_variables)

  start = time.time()
  for epoch in range(args.epochs):
    for bx, by, mask in data:
      step(bx, by, mask)
    eps = dp.accounting.epsilon(optimizer.ledger, args.delta)
    acc = evaluate(model, x_test, y_test)
    print(f"epoch {epoch + 1}: test accuracy {acc:.4f}, epsilon {eps:.4g} at delta "
          f"{args.delta:g}", flush=True)
  report = dp.accounting.privacy_report(optimizer.ledger, delta=args.delta)
  print(report)
  return {"test_accuracy": evaluate(model, x_test, y_test), "epsilon": report.epsilon,
          "delta": args.delta, "steps": int(optimizer.ledger.sample_count.numpy()),
          "epochs": args.epochs, "seconds": round(time.time() - start, 1)}


def evaluate(model, x, y):
  logits = model.predict(x, batch_size=512, verbose=0)
  return float(np.mean(np.argmax(logits, axis=1) == y))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--epochs", type=int, default=15)
  p.add_argument("--quick", action="store_true", help="3 epochs on 2000 examples")
  p.add_argument("--train_size", type=int, default=10000)
  p.add_argument("--test_size", type=int, default=2000)
  p.add_argument("--batch_size", type=int, default=250, help="expected batch size (Poisson)")
  p.add_argument("--l2_norm_clip", type=float, default=1.0)
  p.add_argument("--noise_multiplier", type=float, default=1.1)
  p.add_argument("--learning_rate", type=float, default=0.5)
  p.add_argument("--delta", type=float, default=1e-5)
  args = p.parse_args(argv)
  if args.quick:
    args.epochs, args.train_size, args.test_size, args.batch_size = 3, 2000, 500, 50
  print(json.dumps(train(args)))


if __name__ == "__main__":
  main()
