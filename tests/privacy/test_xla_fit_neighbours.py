"""Add/remove-one neighbours through `fit` under XLA, on a batch size unknown to the trace.

Relation: add or remove one example (Poisson sampling); the ledger records sensitivity C (the
clip norm) for the sum query. This runs the paths the accelerator work changed, all at once:
`fit`'s padded Poisson batches reach the compiled step with an unknown batch size (the rules
must keep their sequence length static), the padded tail runs in a loop of small chunks
after a first chunk of E records (`chunking.PaddedTail`), and Dense layers too large to keep
per-example gradients form their clipped sum from the clip factors (`registry.FactorSums`),
on 2-D and on sequence inputs. With noise 0 and SGD(lr=1) one step moves the weights by
sum_i clip(g_i) / E; every neighbour tried (each real example removed, random examples of
scales 0.3 to 30 added in the tail) must move the sum by at most C, and the sum must equal
the clipped per-example sum of an independent loop.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.data import python_source
import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers
from tests.privacy import neighbours
from tf_dpiter.keras.fast_clipping.rules import dense as dense_rule

CLIP, N, E, REAL, ROWS, T, F = 0.5, 1000, 8, 12, 32, 3, 40
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(sequence):
  keras.utils.set_random_seed(3)
  shape = (T, F) if sequence else (F,)
  layers = [keras.Input(shape), keras.layers.Dense(500, activation="tanh")]   # 20,000 > 16,384
  if sequence:
    layers.append(keras.layers.GlobalAveragePooling1D())
  model = dp.keras.DPSequential(layers + [keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(CLIP, 0.0, learning_rate=1.0,
                                                       clipping="fast"),
                loss=LOSS, jit_compile=True)
  model.optimizer.set_sampling(N, E / N, "poisson", E)
  return model


@pytest.mark.parametrize("sequence", [False, True])
def test_fit_under_xla_moves_the_clipped_sum_by_at_most_c(sequence, monkeypatch):
  factor_sums = []
  for name in ("_dense_sums", "_pinned_dense_sums"):   # on [B, K] inputs: the pinned one
    sums = getattr(dense_rule, name)
    monkeypatch.setattr(dense_rule, name,
                        lambda *a, _s=sums, **k: factor_sums.append(1) or _s(*a, **k))
  model = _model(sequence)
  rng = np.random.RandomState(0)
  x = rng.randn(REAL, *((T, F) if sequence else (F,))).astype("float32")
  y = rng.randint(0, 3, REAL).astype("int64")
  xp, yp, mask = neighbours.padded(x, y, ROWS - REAL)
  spec = (tf.TensorSpec((None,) + xp.shape[1:], tf.float32), tf.TensorSpec([None], tf.int64),
          tf.TensorSpec([None], tf.float32))
  w0 = [np.array(w) for w in model.get_weights()]

  def clipped_sum(xb, yb, wb):
    model.set_weights(w0)
    ds = python_source.python_dataset(lambda: iter([(xb, yb, wb)]), spec)
    model.fit(ds.repeat(), steps_per_epoch=1, epochs=1, verbose=0)
    return E * np.concatenate([(a - b).ravel() for a, b in zip(w0, model.get_weights())]
                              ).astype(np.float64)

  base = clipped_sum(xp, yp, mask)
  model.set_weights(w0)
  ref = helpers.reference_gradient(model, LOSS, tf.constant(x), tf.constant(y), clip=CLIP)
  exact = REAL * np.concatenate([r.ravel() for r in ref])
  # the pinned sums' clip shrink 1 / (1 + eta) (dp_query/summation.rounding_margin): ONE
  # factor for every record of the batch, the first chunk's and the tail's alike
  shrink = float(base @ exact / (exact @ exact))
  assert 1 / (1 + 2e-3) <= shrink <= 1.0, shrink
  np.testing.assert_allclose(base, shrink * exact, rtol=1e-4, atol=1e-5)
  # the rows after the first E = 8 are the tail: removing one of them, or adding one there,
  # changes what the loop runs
  changes = neighbours.add_remove_changes(clipped_sum, xp, yp, mask, REAL, rng, candidates=6)
  assert max(changes) <= CLIP * (1 + 1e-4), max(changes)
  assert max(changes) > 0.5 * CLIP
  assert factor_sums, "the Dense(500) layer did not form its sum from the clip factors"
  run = model.ledger.to_dict()["runs"][-1]
  assert max(q["sensitivity"] for q in run["queries"]) == pytest.approx(CLIP)
