"""Chooses the tutorial's learning-rate schedule and weight averaging on a validation split.

  python benchmarks/tutorial_ema_validation.py [--epochs 60] [--momenta 0.99,0.995,0.999]
      [--data_path ../shared/data/mnist.npz] [--eval_every 5] [--learning_rate 0.15]
      [--decay constant|cosine]

Trains the MNIST tutorial's DP-SGD run (TF Privacy's CNN, clip 1.0, noise 1.1, lr 0.15,
Poisson samples of expected size 256 through `fit`; --learning_rate and --decay vary) on the
first 50,000 training images and
evaluates on the last 10,000 training images (the validation split; the test set is not
read). Beside the raw iterate it keeps exponential moving averages of the weights, one per
momentum m (the rule of Keras' `use_ema=True`: the average starts at the first iterate, then
avg <- m avg + (1 - m) w after every step). Averaging the released iterates is
post-processing of the DP outputs: it costs no privacy (McMahan et al. 2018, Section 1; De et al. 2022
average iterates the same way). Prints one JSON line per evaluation: epoch, validation
accuracy of the raw weights and of each average.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dpiter as dp  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class WeightAverages(keras.callbacks.Callback):
  """Exponential moving averages of the trainable weights, one per momentum, and their
  validation accuracy every `eval_every` epochs (and at the last epoch)."""

  def __init__(self, momenta, x_val, y_val, eval_every, epochs):
    super().__init__()
    self.momenta, self.x_val, self.y_val = momenta, x_val, y_val
    self.eval_every, self.epochs = eval_every, epochs
    self.avgs = None

  def on_train_begin(self, logs=None):
    ws = self.model.trainable_variables
    self.avgs = {m: [tf.Variable(w, trainable=False) for w in ws] for m in self.momenta}

    @tf.function
    def update():
      for m, avg in self.avgs.items():
        for a, w in zip(avg, ws):
          a.assign(m * a + (1.0 - m) * w)
    self._update = update

  def on_train_batch_end(self, batch, logs=None):
    self._update()

  def _accuracy(self):
    _, acc = self.model.evaluate(self.x_val, self.y_val, batch_size=1000, verbose=0)
    return round(float(acc), 4)

  def on_epoch_end(self, epoch, logs=None):
    if (epoch + 1) % self.eval_every and epoch + 1 != self.epochs:
      return
    ws = self.model.trainable_variables
    raw = [w.numpy() for w in ws]
    row = {"epoch": epoch + 1, "raw": self._accuracy()}
    for m, avg in self.avgs.items():
      for w, a in zip(ws, avg):
        w.assign(a)
      row[f"ema_{m}"] = self._accuracy()
    for w, r in zip(ws, raw):
      w.assign(r)
    print(json.dumps(row), flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data_path", default=os.path.join(REPO, "..", "shared", "data", "mnist.npz"))
  p.add_argument("--epochs", type=int, default=60)
  p.add_argument("--momenta", default="0.99,0.995,0.999")
  p.add_argument("--eval_every", type=int, default=5)
  p.add_argument("--learning_rate", type=float, default=0.15)
  p.add_argument("--decay", choices=["constant", "cosine"], default="constant",
                 help="cosine: keras.optimizers.schedules.CosineDecay to 0 over the run")
  a = p.parse_args()
  with np.load(a.data_path) as d:
    x, y = d["x_train"], d["y_train"]
  x = (x.astype("float32") / 255.0)[..., None]
  y = y.astype("int32")
  xtr, ytr, xval, yval = x[:50000], y[:50000], x[50000:], y[50000:]
  model = dp.keras.DPSequential(dp.keras.example_models.mnist_cnn_layers())
  lr = a.learning_rate if a.decay == "constant" else keras.optimizers.schedules.CosineDecay(
      a.learning_rate, decay_steps=a.epochs * round(50000 / 256))
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=lr),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                weighted_metrics=["accuracy"])
  momenta = [float(m) for m in a.momenta.split(",") if m]
  t0 = time.time()
  model.fit(xtr, ytr, batch_size=256, epochs=a.epochs, verbose=0,
            callbacks=[WeightAverages(momenta, xval, yval, a.eval_every, a.epochs)])
  eps = dp.accounting.privacy_report(model.ledger, delta=1e-5).epsilon
  print(json.dumps({"epsilon_50k": round(float(eps), 4), "seconds": round(time.time() - t0),
                    "learning_rate": a.learning_rate, "decay": a.decay}))


if __name__ == "__main__":
  main()
