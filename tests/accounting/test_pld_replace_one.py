"""PLD under replace one: the ledger's noise multiplier is sigma over the replace-one
sensitivity 2S, which dp-accounting's PLD under REPLACE_ONE would read as sigma over S (its
mean moves by -S and +S) and so charge 4S (review R: epsilon 45.93 against 17.76).

Independent value: shuffled passes release one un-amplified Gaussian sum per pass; replacing
one example moves each pass's sum by at most 2S, so 3 passes of sigma = 4 S are one
Gaussian mechanism of mu = 2 sqrt(3) / 4 and delta(eps) = Phi(-eps / mu + mu / 2) -
e^eps Phi(-eps / mu - mu / 2) (Balle & Wang, "Improving the Gaussian mechanism for
differential privacy", Theorem 8), solved for eps with scipy."""

import math
import warnings

import keras
import numpy as np
import pytest
from scipy import optimize
from scipy import stats

import tf_dpiter as dp

N, B, Z, DELTA, PASSES = 200, 20, 4.0, 1e-5, 3


def _exact_epsilon(mu, delta):
  def gap(eps):
    return (stats.norm.cdf(-eps / mu + mu / 2)
            - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta)
  return optimize.brentq(gap, 0.0, 200.0, xtol=1e-12)


def test_shuffled_passes_pld_epsilon_is_the_exact_gaussian_epsilon():
  rng = np.random.RandomState(0)
  x, y = rng.randn(N, 3).astype("float32"), rng.randint(0, 2, N)
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, Z, learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=B, epochs=PASSES, sampling="shuffle", verbose=0)
  assert int(model.ledger.passes.numpy()) == PASSES
  exact = _exact_epsilon(2.0 * math.sqrt(PASSES) / Z, DELTA)
  pld = dp.accounting.epsilon(model.ledger, DELTA, accountant="pld")
  rdp = dp.accounting.epsilon(model.ledger, DELTA, accountant="rdp")
  assert pld == pytest.approx(exact, rel=2e-3), (pld, exact)   # PLD's discretization: above
  assert pld >= exact * (1 - 1e-6)                              # never below the truth
  assert exact <= rdp and pld < rdp, (exact, pld, rdp)
