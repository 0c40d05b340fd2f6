"""Review: the DP optimizer's released noise, seen from the weights only (noise on).

A Dense(300 -> 40) on all-zero records: the kernel's gradient is exactly 0 for every record,
so the kernel's update is -lr * noise / (q n), 12,000 coordinates of the released noise.
Checked with `train_on_batch` in a graph and under jit_compile=True, with the noise drawn
inside and outside the compiled program:
- sigma applied once: var(update) / (z S lr / (q n))^2 = 1 within 5 standard errors
  (sqrt(2 / 12,000));
- never replayed: after rolling the kernel and `iterations` back (assign), after
  `tf.train.Checkpoint.restore`, after `load_weights`, and in a new `fit` on the rolled-back
  model, the retaken step's noise is uncorrelated with the step it replaces (values and
  squares: |corr| < 5 / sqrt(12,000)), and not equal;
- the ledger holds one sample per released update;
- two unseeded optimizers built alike in one process draw independent first updates (under
  jit_compile=True, the noise drawn outside the compiled program).
"""

import math

import keras
import numpy as np
import pytest

import tf_dpiter as dp

S, Z, N, Q, B, LR = 0.5, 3.0, 1000, 0.016, 16, 2.0
LIMIT = 5 / math.sqrt(12_000)


def _model(jit, compiled_noise):
  model = dp.keras.DPSequential([keras.Input((300,)), keras.layers.Dense(40)])
  opt = dp.keras.DPKerasSGDOptimizer(S, Z, learning_rate=LR)
  opt.private_step.set_flags(compiled_noise=compiled_noise)
  model.compile(opt, keras.losses.MeanSquaredError(), jit_compile=jit)
  opt.set_sampling(N, Q, "poisson")
  return model, opt


def _zeros():
  return np.zeros([B, 300], "float32"), np.zeros([B, 40], "float32")


def _step(model):
  kernel = model.layers[0].kernel
  before = kernel.numpy().copy()
  model.train_on_batch(*_zeros())
  return (kernel.numpy() - before).ravel().astype(np.float64), before


def _corr(a, b):
  a, b = a - a.mean(), b - b.mean()
  return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _assert_fresh(u1, u2, label):
  assert not np.array_equal(u1, u2), label
  c1, c2 = _corr(u1, u2), _corr(u1 * u1, u2 * u2)
  assert abs(c1) < LIMIT and abs(c2) < LIMIT, (label, c1, c2)


def _assert_sigma_once(u, label):
  expected = Z * S * LR / (Q * N)
  ratio = float(np.mean(u * u)) / expected ** 2   # the kernel's noise has mean 0
  assert abs(ratio - 1.0) < 5 * math.sqrt(2.0 / u.size), (label, ratio)


# Default: one case per path (graph; XLA with its compiled draw); XLA with the host draw
# (~60 s) runs with -m slow.
@pytest.mark.parametrize("jit, compiled_noise", [
    (False, False), pytest.param(True, False, marks=pytest.mark.slow), (True, True)])
def test_sigma_once_and_no_replay_after_rollbacks(jit, compiled_noise, tmp_path):
  model, opt = _model(jit, compiled_noise)
  kernel = model.layers[0].kernel
  released = 0
  u0, _ = _step(model)
  released += 1
  _assert_sigma_once(u0, "first step")

  # 1. rollback by assign: kernel and iterations back, the step again
  counter = int(opt.iterations.numpy())
  u1, start = _step(model)
  kernel.assign(start)
  opt.iterations.assign(counter)
  u2, _ = _step(model)
  released += 2
  _assert_fresh(u1, u2, "iterations.assign")
  _assert_sigma_once(u2, "after assign")

  # 2. checkpoint restore
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
  saved = ckpt.save(str(tmp_path / "ck"))
  u3, start = _step(model)
  ckpt.restore(saved)
  np.testing.assert_array_equal(kernel.numpy(), start)
  u4, _ = _step(model)
  released += 2
  _assert_fresh(u3, u4, "checkpoint restore")

  # 3. load_weights
  model.save_weights(str(tmp_path / "w.weights.h5"))
  u5, start = _step(model)
  model.load_weights(str(tmp_path / "w.weights.h5"))
  np.testing.assert_array_equal(kernel.numpy(), start)
  u6, _ = _step(model)
  released += 2
  _assert_fresh(u5, u6, "load_weights")

  # 4. a new fit on the rolled-back model (fit builds its own train function)
  counter = int(opt.iterations.numpy())
  u7, start = _step(model)
  kernel.assign(start)
  opt.iterations.assign(counter)
  x, y = _zeros()
  with pytest.warns(UserWarning, match="stated over N=1000"):
    model.fit(x, y, batch_size=B, epochs=1, steps_per_epoch=1, verbose=0)
  assert int(opt.iterations.numpy()) == counter + 1
  u8 = (kernel.numpy() - start).ravel().astype(np.float64)
  released += 2
  _assert_fresh(u7, u8, "new fit")

  for a, b in ((u0, u2), (u2, u4), (u4, u6), (u1, u3)):
    _assert_fresh(a, b, "distinct steps")
  assert int(opt.ledger.sample_count.numpy()) == released

  if jit and not compiled_noise:
    # 5. a second unseeded optimizer built alike in this process (once: one more model and
    # trace): its first update is independent of the first model's (each generator seeded
    # from OS entropy, not from a shared default)
    other, _ = _model(jit, compiled_noise)
    _assert_fresh(u0, _step(other)[0], "two models")
