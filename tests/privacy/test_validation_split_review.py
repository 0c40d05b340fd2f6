"""Review R (session 30): `fit(..., validation_split=s)` on arrays and the neighbouring relation
the run's statement claims (add or remove ONE example of the data given to fit).

fit_sampling._split_validation trains on x[:floor(n (1 - s))] and validates on the rest. The
boundary depends on n, so removing one training example can ALSO move the first validation
example into the training part: the two datasets' training sets then differ by two examples,
and the DP-SGD guarantee (Abadi et al., "Deep Learning with Differential Privacy", CCS 2016,
Sec. 3.1; Mironov, Talwar and Zhang, "Renyi Differential Privacy of the Sampled Gaussian
Mechanism", 2019: one record added or removed) covers them only as a group of two (Dwork and
Roth, "The Algorithmic Foundations of Differential Privacy", Thm. 2.2). The held-out
examples' validation metrics are also released without noise.

Observed exactly: a bias-free Dense(1) from zero weights on one-hot inputs (example j is e_j,
label 1, loss y * output: its gradient is e_j, norm C = 1, clip factor 1), noise 0, SGD lr 1,
normalize=False, Poisson at q = 1 (population_size = batch_size = 201: every training example
in the one step): the kernel's row j moves (by C times the clip shrink) iff example j trained.

Measured at 854cb19: D = the 201 examples, D' = D without example 0, s = 0.25: D trains on
{0..149}, D' on {1..150}: 2 examples differ (the ledger: add/remove one, sensitivity C).
Without validation_split: 1 (passes).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp

M = 201


def _loss(y_true, y_pred):
  return tf.reduce_sum(y_true * y_pred, axis=-1)


def _trained(rows, **fit_kwargs):
  """The examples (indices into the 201) whose gradient entered the step."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((M,)), keras.layers.Dense(
      1, use_bias=False, kernel_initializer="zeros")])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # noise 0
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 0.0, learning_rate=1.0, normalize=False)
    model.compile(optimizer=opt, loss=_loss)
    x = np.eye(M, dtype=np.float32)[rows]
    model.fit(x, np.ones((len(rows), 1), np.float32), batch_size=M, population_size=M,
              epochs=1, verbose=0, **fit_kwargs)
  run = model.ledger.to_dict()["runs"][-1]
  assert run["relation"] == "add_or_remove_one" and run["count"] == 1
  kernel = model.get_weights()[0].ravel()
  moved = kernel[kernel != 0]
  assert np.all((moved >= -1.0) & (moved < -0.99))   # each by C times the clip shrink
  return set(np.flatnonzero(kernel).tolist())


def _differ(**fit_kwargs):
  d = _trained(list(range(M)), **fit_kwargs)
  d2 = _trained(list(range(1, M)), **fit_kwargs)
  return len(d ^ d2)


def test_without_validation_split_neighbours_train_on_neighbouring_sets():
  assert _differ() == 1


@pytest.mark.xfail(strict=True, reason=(
    "854cb19: validation_split=0.25, 201 vs 200 examples (example 0 removed): the training "
    "sets are {0..149} and {1..150}, 2 examples differ under an add/remove-one statement"))
def test_validation_split_keeps_neighbours_one_example_apart():
  assert _differ(validation_split=0.25) == 1
