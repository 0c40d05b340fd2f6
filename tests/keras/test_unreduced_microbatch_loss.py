"""TF Privacy's idiom — a loss with reduction=None and num_microbatches — on both clipping
paths: the step (noise 0) is the mean of the clipped microbatch gradients, each microbatch's
loss the mean of its examples' losses. The fast path failed with a reshape error when a
microbatch held more than one example (the unreduced loss gave k values per record)."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers

B, M = 8, 4


@pytest.mark.parametrize("clipping", ["fast", "vectorized"])
def test_unreduced_loss_with_microbatches_equals_reference(clipping):
  x, y = helpers.small_data(B, seed=4)
  model = helpers.small_seq()
  model.compile(
      optimizer=dp.keras.DPKerasSGDOptimizer(0.05, 0.0, M, learning_rate=1.0,
                                             clipping=clipping),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None))
  model(x)
  mean_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  ref = helpers.reference_gradient(model, mean_loss, x, y, clip=0.05, num_microbatches=M)
  helpers.set_sampling(model, B)
  got = helpers.one_step_update(model, x, y)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)
  assert max(np.abs(r).max() for r in ref) > 0
