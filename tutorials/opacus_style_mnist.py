"""An Opacus user's MNIST script, written for tf_dpiter and Keras 3.

Opacus' MNIST example builds a small CNN, asks `PrivacyEngine.make_private_with_epsilon` for a
private model, optimizer and Poisson data loader calibrated to a target epsilon, and trains in
a loop (`optimizer.zero_grad(); loss.backward(); optimizer.step()`), printing
`privacy_engine.get_epsilon(delta)` after every epoch. Here:

  * `model, optimizer = dp.keras.make_private_with_epsilon(model, optimizer, epsilon=...,
    delta=..., epochs=..., batch_size=..., population_size=n, l2_norm_clip=MAX_GRAD_NORM)`
    (the noise multiplier calibrated by the accountant for ceil(epochs n / B) Poisson steps);
  * `dp.data.poisson_batches(x, y, expected_batch_size=B)` is the `DPDataLoader`: each example
    joins each batch independently with probability q = B / n; batches are padded to a fixed
    size with rows of weight 0 (the mask), which join no record;
  * one step `model.train_on_batch(images, target, sample_weight=mask)` is zero_grad +
    backward + step: per-example gradients clipped to MAX_GRAD_NORM, one Gaussian noise draw,
    the update, and the step written to the privacy ledger;
  * `model.privacy_statement(DELTA).epsilon` is `privacy_engine.get_epsilon(DELTA)`: epsilon of
    the steps taken, from the ledger (RDP accountant, dp-accounting). Privacy claim: (epsilon,
    delta)-DP for adding or removing one example.

  python tutorials/opacus_style_mnist.py --quick     # 2000 examples, 2 epochs
  python tutorials/opacus_style_mnist.py             # 60000 examples, 10 epochs, target epsilon 2

The last line printed is JSON: {"test_accuracy", "epsilon", "delta", "steps", ...}.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402  (was: import tensorflow_privacy)


def make_model():
  """Opacus' SampleConvNet: conv 16 8x8/2, max-pool 2/1, conv 32 4x4/2, max-pool 2/1, dense 32,
  10 logits."""
  return keras.Sequential(dp.keras.example_models.mnist_cnn_layers())   # TF Privacy's CNN


def test(model, test_data, test_labels):
  logits = model.predict(test_data, batch_size=500, verbose=0)
  return float(np.mean(np.argmax(logits, axis=1) == test_labels))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data_path", default=dp.data.default_mnist_path())
  p.add_argument("--quick", action="store_true", help="2 epochs on 2000 training examples")
  p.add_argument("--lr", type=float, default=0.25)
  p.add_argument("--epsilon", type=float, default=2.0, help="target epsilon")
  p.add_argument("--delta", type=float, default=1e-5)
  p.add_argument("--max_grad_norm", type=float, default=1.0)
  p.add_argument("--batch_size", type=int, default=256)
  p.add_argument("--epochs", type=int, default=10)
  args = p.parse_args(argv)
  train_size, test_size = (2000, 500) if args.quick else (None, None)
  if args.quick:
    args.epochs, args.batch_size, args.epsilon = 2, 100, 4.0
  train_data, train_labels, test_data, test_labels = dp.data.load_mnist(
      args.data_path, train_size, test_size)

  model = make_model()
  optimizer = keras.optimizers.SGD(learning_rate=args.lr, momentum=0.0)
  model, optimizer = dp.keras.make_private_with_epsilon(   # privacy_engine.make_private_with_epsilon
      model, optimizer, epsilon=args.epsilon, delta=args.delta, epochs=args.epochs,
      batch_size=args.batch_size, population_size=len(train_data),
      l2_norm_clip=args.max_grad_norm)
  model.compile(optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  print(f"Using sigma={optimizer.noise_multiplier:.4f} and C={args.max_grad_norm}")
  train_loader = dp.data.poisson_batches(train_data, train_labels,   # the DPDataLoader
                                         expected_batch_size=args.batch_size)
  spec = dp.data.get_sampling_spec(train_loader)
  optimizer.set_sampling(spec.population_size, spec.selection_probability, spec.policy,
                         spec.sample_size)

  for epoch in range(1, args.epochs + 1):
    losses = []
    for images, target, mask in train_loader:
      # optimizer.zero_grad(); loss = criterion(model(images), target); loss.backward();
      # optimizer.step()  -- clipped per-example gradients, noise, update, ledger
      losses.append(float(model.train_on_batch(images, target, sample_weight=mask)))
    epsilon = model.privacy_statement(args.delta).epsilon   # privacy_engine.get_epsilon(delta)
    print(f"Train Epoch: {epoch} \tLoss: {np.mean(losses):.6f} "
          f"(epsilon = {epsilon:.2f}, delta = {args.delta})", flush=True)
  accuracy = test(model, test_data, test_labels)
  statement = model.privacy_statement(args.delta)
  print(statement)
  print(f"Test set: accuracy {accuracy:.4f}; epsilon {statement.epsilon:.4g} "
        f"(target {args.epsilon:g}) at delta {args.delta:g}")
  print(json.dumps({
      "test_accuracy": round(accuracy, 4), "epsilon": statement.epsilon,
      "target_epsilon": args.epsilon, "delta": args.delta, "steps": statement.steps,
      "sampling": statement.policy, "q": statement.selection_probability,
      "noise_multiplier": float(optimizer.noise_multiplier), "train_size": len(train_data)}))


if __name__ == "__main__":
  main()
