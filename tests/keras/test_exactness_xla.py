"""On the XLA path (jit_compile=True, what Keras turns on by itself on a GPU/TPU machine) each
example's contribution is clipped alone, so removing one example moves the pre-noise sum by
at most C (add/remove one example, the relation the ledger records for Poisson samples),
on the fast and on the vectorized path. The update's exactness under XLA on every other axis
is test_step_oracle.py's."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers
from tests.keras import test_exactness as base

LOSS = base.LOSS
B, CLIP = base.B, 0.05

# nightly (tests/conftest.py): the vectorized path's case. By default the vectorized path under
# XLA is checked on this conv model by test_step_oracle.py (model=conv, clipping=vectorized,
# jit=True: the update is the sum of the records clipped alone to C, so removing one record
# moves it by at most C) and by tests/privacy/test_neighbouring_paths.py::
# test_jit_and_physical_batches[vectorized-True-None] (neighbours removed and added, the
# measured move at most the recorded sensitivity C and above half of it).
SLOW_CASES = {"test_xla_removing_one_example_moves_the_sum_by_at_most_the_clip[vectorized]"}


def _compiled(kind, clipping):
  model = base._model(kind)  # pylint: disable=protected-access
  opt = dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0, clipping=clipping)
  model.compile(optimizer=opt, loss=LOSS, jit_compile=True)
  return model


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
