"""Correlated noise in Keras: `noise="band_mf" | "blt" | "tree"` beside DP-SGD on MNIST.

The DP optimizers take the mechanism as an argument; `model.fit` is unchanged, only the data
must be sampled the way the mechanism's accounting needs:

  noise="iid"      DP-SGD, Poisson sampling      fit(x, y, batch_size=B)
  noise="band_mf"  BandMF, b bands               dp.data.cyclic_poisson_batches(..., num_groups=b)
  noise="blt"      BLT, min_separation b         dp.data.cyclic_poisson_batches(..., num_groups=b)
  noise="tree"     DP-FTRL, restart every pass   fit(x, y, batch_size=B, sampling="shuffle")

Every run prints its test accuracy and the epsilon dp-accounting gives for its ledger (the
same noise_multiplier gives each mechanism a different epsilon: each is accounted by its own
rule; for accuracy at equal epsilon see benchmarks/correlated_noise_mnist.py), then
the BandMF run is interrupted halfway, saved with `model.save`, reloaded and finished: the
resumed weights equal the uninterrupted ones. The mechanism's noise history is the noise of
the released weights, so no model file holds it: the run resumes through
`opt.save_noise_state(path)` / `opt.restore_noise_state(path)`, a file as secret as
the data (without it the restored fit is refused); the seeded generator state is an optimizer
variable and the ledger continues through `ledger_journal`.

  python tutorials/correlated_noise_keras.py --quick
  python tutorials/correlated_noise_keras.py --data_path ../shared/data/mnist.npz --epochs 4

The seeds make the runs reproducible, hence NOT private: a tutorial only.
"""

import argparse
import json
import os
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.environ.get("TF_DPITER_MNIST",
                              os.path.join(REPO, "..", "shared", "data", "mnist.npz"))
DELTA = 1e-5


def load(path, n_train):
  """(x_train, y_train, x_test, y_test): the first n_train training images, scaled to [0, 1]."""
  with np.load(path) as f:
    x, y, xt, yt = f["x_train"], f["y_train"], f["x_test"], f["y_test"]
  x = x[:n_train].reshape(-1, 784).astype("float32") / 255.0
  return x, y[:n_train].astype("int64"), xt.reshape(-1, 784).astype("float32") / 255.0, yt


def make_model(noise, steps, args, journal=None):
  """A 784-64-10 MLP compiled with a DP Adam of the given noise mechanism."""
  keras.utils.set_random_seed(0)
  params = {"iid": {}, "band_mf": {"num_bands": args.groups, "num_steps": steps},
            "blt": {"num_steps": steps, "min_separation": args.groups},
            "tree": {"restart_every": args.steps_per_pass}}[noise]
  model = dp.keras.DPSequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"),
                                 keras.layers.Dense(10)])
  opt = dp.keras.DPKerasAdamOptimizer(args.clip, args.noise_multiplier, noise=noise, seed=1,
                                      learning_rate=args.lr, ledger_journal=journal, **params)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
  return model


def data_for(noise, x, y, args):
  """The sampled data each mechanism's accounting covers (module docstring)."""
  if noise == "iid":
    return dp.data.poisson_batches(x, y, expected_batch_size=args.batch,
                                   steps_per_epoch=args.steps_per_pass, seed=2)
  if noise == "tree":
    return dp.data.shuffled_batches(x, y, batch_size=len(x) // args.steps_per_pass, seed=2)
  return dp.data.cyclic_poisson_batches(x, y, expected_batch_size=args.batch,
                                        num_groups=args.groups,
                                        steps_per_epoch=args.steps_per_pass, seed=2)


def run(noise, x, y, xt, yt, args):
  """Trains one mechanism; returns its test accuracy and epsilon."""
  steps = args.epochs * args.steps_per_pass
  model = make_model(noise, steps, args)
  model.fit(data_for(noise, x, y, args), epochs=args.epochs, verbose=0)
  acc = float(model.evaluate(xt, yt, verbose=0)[1])
  return {"noise": noise, "test_accuracy": acc,
          "epsilon": dp.accounting.epsilon(model.ledger, DELTA), "steps": steps}


def resume_demo(x, y, args):
  """BandMF: T steps in one go vs T/2, model.save, load_model, T/2: the largest weight gap."""
  steps, half = args.epochs * args.steps_per_pass, max(1, args.epochs // 2)
  tmp = tempfile.mkdtemp()
  straight = make_model("band_mf", steps, args, journal=os.path.join(tmp, "a.journal"))
  ds = data_for("band_mf", x, y, args)
  straight.fit(ds, epochs=half, verbose=0)
  straight.fit(ds, epochs=args.epochs - half, verbose=0)
  first = make_model("band_mf", steps, args, journal=os.path.join(tmp, "b.journal"))
  ds = data_for("band_mf", x, y, args)
  first.fit(ds, epochs=half, verbose=0)
  first.save(os.path.join(tmp, "half.keras"))
  # the noise state: private, as secret as the data (never shipped with the model)
  first.optimizer.save_noise_state(os.path.join(tmp, "half.noise.npz"))
  resumed = keras.models.load_model(os.path.join(tmp, "half.keras"))
  resumed.optimizer.restore_noise_state(os.path.join(tmp, "half.noise.npz"))
  resumed.fit(ds, epochs=args.epochs - half, verbose=0)
  gap = max(float(np.max(np.abs(a.numpy() - b.numpy())))
            for a, b in zip(straight.trainable_variables, resumed.trainable_variables))
  return {"max_weight_difference": gap,
          "epsilon_straight": dp.accounting.epsilon(straight.ledger, DELTA),
          "epsilon_resumed": dp.accounting.epsilon(resumed.ledger, DELTA)}


def main():
  """Parses the flags, runs the four mechanisms and the resume demo, prints JSON."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--data_path", default=DEFAULT_DATA)
  p.add_argument("--n_train", type=int, default=12000)
  p.add_argument("--epochs", type=int, default=4)
  p.add_argument("--steps_per_pass", type=int, default=48)
  p.add_argument("--groups", type=int, default=4, help="cyclic groups = BandMF bands")
  p.add_argument("--noise_multiplier", type=float, default=1.0)
  p.add_argument("--clip", type=float, default=1.0)
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--quick", action="store_true", help="2000 examples, 2 epochs of 16 steps")
  args = p.parse_args()
  if args.quick:
    args.n_train, args.epochs, args.steps_per_pass = 2000, 2, 16
  x, y, xt, yt = load(args.data_path, args.n_train)
  args.batch = len(x) / args.steps_per_pass   # expected batch, the same for every run
  warnings.simplefilter("ignore")   # the tutorial's seeds (not private)
  results = [run(noise, x, y, xt, yt, args) for noise in ("iid", "band_mf", "blt", "tree")]
  for r in results:
    print(f"{r['noise']:8s} test accuracy {r['test_accuracy']:.4f}  epsilon {r['epsilon']:.3f} "
          f"(delta {DELTA:g}, {r['steps']} steps)")
  demo = resume_demo(x, y, args)
  print(f"band_mf resumed from model.save: max |weight difference| "
        f"{demo['max_weight_difference']:.3g}, epsilon {demo['epsilon_resumed']:.3f} "
        f"(uninterrupted {demo['epsilon_straight']:.3f})")
  print(json.dumps({"runs": results, "resume": demo}))


if __name__ == "__main__":
  main()
