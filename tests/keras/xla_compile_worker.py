"""Runs a 3-epoch DP fit with jit_compile=True and prints the ledger's sample count and the
optimizer's iterations (tests/keras/test_xla_compile_once.py reads TensorFlow's XLA log for
the number of compilations).

Usage: python xla_compile_worker.py CASE [CASE ...], CASE in {fast,vectorized,band_mf,cnn}:
the cases run one after the other, each after a line `@@CASE name@@` on stderr (where
TensorFlow logs the compilations) and `CASE name` on stdout.
"""

import sys

import keras
import numpy as np

import tf_dpiter as dp
from tf_dpiter.keras.optimizer import weight_fingerprints


def main(case):
  rng = np.random.default_rng(0)
  n, batch = 96, 16
  if case == "cnn":
    x = rng.random((n, 12, 12, 1), dtype=np.float32)
    layers = [keras.Input((12, 12, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
              keras.layers.Conv2D(4, 3, strides=2), keras.layers.Flatten(),
              keras.layers.Dense(10)]
  else:
    x = rng.random((n, 20), dtype=np.float32)
    layers = [keras.Input((20,)), keras.layers.Dense(16, activation="relu"),
              keras.layers.Dense(10)]
  y = rng.integers(0, 10, n)
  kwargs = {"clipping": "vectorized"} if case == "vectorized" else {}
  if case == "band_mf":
    kwargs.update(noise="band_mf", num_bands=2, num_steps=18)
  model = dp.keras.DPSequential(layers=layers)
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1, seed=1, **kwargs)
  model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=True)
  if case == "band_mf":   # BandMF is accounted under cyclic Poisson (b >= num_bands groups)
    data = dp.data.cyclic_poisson_batches(x, y, expected_batch_size=8, num_groups=2,
                                          steps_per_epoch=6, seed=2)
    model.fit(data, epochs=3, verbose=0)
  else:
    model.fit(x, y, batch_size=batch, epochs=3, verbose=0)
  print("ITERATIONS", int(opt.iterations.numpy()))
  print("SAMPLES", int(model.optimizer.ledger.sample_count.numpy()))
  # the weight fingerprints' digest is one XLA program per distinct shape of a variable of
  # more than weight_fingerprints.HOST_ELEMENTS values (smaller ones are digested on the host)
  print("SHAPES", len({tuple(v.shape) for v in model.trainable_variables
                       if int(np.prod(v.shape)) > weight_fingerprints.HOST_ELEMENTS}),
        flush=True)


if __name__ == "__main__":
  for name in sys.argv[1:]:
    sys.stderr.write(f"@@CASE {name}@@\n")
    sys.stderr.flush()
    print("CASE", name, flush=True)
    main(name)
