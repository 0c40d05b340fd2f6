"""The exactness suite on the XLA path (jit_compile=True, what Keras turns on by itself on a
GPU/TPU machine): with noise 0 one step's update is -lr * (sum of per-example gradients, each
clipped to C) / B, on the fast and on the vectorized path. Each example's contribution is
clipped alone, so removing one example moves the pre-noise sum by at most C (add/remove one
example, the relation the ledger records for Poisson samples): checked directly below."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers
from tests.keras import test_exactness as base

LOSS = base.LOSS
B, CLIP = base.B, 0.05


def _compiled(kind, clipping):
  model = base._model(kind)  # pylint: disable=protected-access
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0, clipping=clipping)
  model.compile(optimizer=opt, loss=LOSS, jit_compile=True)
  return model


@pytest.mark.parametrize("clipping", ["fast", "vectorized"])
@pytest.mark.parametrize("kind", ["dense", "conv", "embedding", "multi_input"])
def test_xla_step_equals_mean_of_clipped_per_example_gradients(kind, clipping):
  rng = np.random.RandomState(0)
  x, y = base._data(kind, rng)  # pylint: disable=protected-access
  model = _compiled(kind, clipping)
  model(x)
  ref = helpers.reference_gradient(model, LOSS, x, y, clip=CLIP)
  helpers.set_sampling(model, B)
  got = helpers.one_step_update(model, x, y)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)
  assert max(np.abs(r).max() for r in ref) > 0


@pytest.mark.parametrize("clipping", ["fast", "vectorized"])
def test_xla_removing_one_example_moves_the_sum_by_at_most_the_clip(clipping):
  rng = np.random.RandomState(4)
  x, y = base._data("conv", rng)  # pylint: disable=protected-access
  sums = []
  for rows in (slice(0, B), slice(1, B)):   # neighbours: example 0 removed
    model = _compiled("conv", clipping)
    model(x)
    model.optimizer.set_sampling(B, 1.0, "poisson", B)   # expected batch B: fixed denominator
    # the update is -lr * sum / B with B the declared (expected) batch size: the same
    # denominator for both neighbours, so B * update is the pre-noise clipped sum
    sums.append([B * g for g in helpers.one_step_update(model, x[rows], y[rows])])
  moved = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(*sums)))
  assert 1e-4 < moved <= CLIP * (1 + 1e-4)
