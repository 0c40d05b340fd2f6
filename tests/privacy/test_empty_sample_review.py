"""Review R (session 31): a Poisson sample that holds no record is still a step: its noise is
released at the full scale and the ledger charges it.

Abadi et al., "Deep Learning with Differential Privacy" (CCS 2016), Sec. 3.1, and Mironov,
Talwar and Zhang, "Renyi Differential Privacy of the Sampled Gaussian Mechanism" (2019): the
sampled Gaussian mechanism releases sum + N(0, (z C)^2) whatever the sample holds, empty
included. A step skipped, or released without noise, when the sample is empty would tell the
sample's size ((1 - q)^n on D, (1 - q)^(n+1) on D' = D + r) and is not what the ledger charges.

Checks (noise on, z = 2, C = 1, SGD lr 1, a bias-free Dense(300 -> 40) from zero weights,
normalize=True: the update is the noised sum / (q N) with q N = B = 16 declared):
- train_on_batch on an empty batch (0 rows) and on 16 padding rows (sample weight 0): the
  12,000 kernel coordinates' variance is (z C / B)^2 within 5 standard errors
  (sqrt(2 / 12,000)), the ledger holds one sample;
- fit on 20 arrays at batch_size 1 (q = 1/20, 40 steps: about 14 empty samples), unpadded
  (graph) and padded (XLA): 40 ledger samples and 40 optimizer iterations.
Passed at 86d7223 and 4fec2fd (ratios 0.99-1.02).
"""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp

Z, C, B = 2.0, 1.0, 16


def _model(clipping, jit, d_in=300, d_out=40):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((d_in,)), keras.layers.Dense(
      d_out, use_bias=False, kernel_initializer="zeros")])
  opt = dp.keras.DPKerasSGDOptimizer(C, Z, learning_rate=1.0, clipping=clipping)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=jit)
  return model, opt


@pytest.mark.parametrize("clipping, rows", [
    ("vectorized", 0), ("fast", 16),
    pytest.param("fast", 0, marks=pytest.mark.slow),
    pytest.param("vectorized", 16, marks=pytest.mark.slow)])
def test_an_empty_sample_releases_full_noise_and_is_charged(clipping, rows):
  model, opt = _model(clipping, False)
  opt.set_sampling(1 << 20, B / (1 << 20), "poisson", B)
  x = np.random.default_rng(0).random((rows, 300), np.float32)
  y = np.zeros(rows, np.int32)
  model.train_on_batch(x, y, sample_weight=np.zeros(rows, np.float32) if rows else None)
  update = model.get_weights()[0].astype(np.float64).ravel()
  ratio = float(np.var(update)) / (Z * C / B) ** 2
  assert abs(ratio - 1.0) <= 5 * np.sqrt(2.0 / update.size), ratio
  assert int(model.ledger.sample_count) == 1


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fit_charges_its_empty_samples(jit):
  model, opt = _model("fast", jit, d_in=4, d_out=2)
  rng = np.random.default_rng(0)
  x = rng.random((20, 4), np.float32)
  y = (x.sum(axis=1) > 2).astype(np.int32)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=1, epochs=1, steps_per_epoch=40, population_size=20, verbose=0)
  assert (int(model.ledger.sample_count), int(opt.iterations)) == (40, 40)
  assert all(np.isfinite(w).all() for w in model.get_weights())
