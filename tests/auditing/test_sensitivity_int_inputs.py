"""`auditing.check_sensitivity` on integer (token-id) inputs: its candidates stay inside the
observed id range, so an Embedding model can be checked (random noise or negated ids cast to
int were out of the table: InvalidArgumentError in the gather)."""

import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.auditing import sensitivity

_candidates = sensitivity._candidates   # pylint: disable=protected-access


@pytest.mark.parametrize("policy", ["poisson", "shuffle"])
def test_check_sensitivity_runs_on_an_embedding_model(policy):
  rng = np.random.RandomState(0)
  inp = keras.Input((5,), dtype="int32")
  h = keras.layers.Embedding(7, 4)(inp)
  out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
  model = dp.keras.DPModel(inp, out)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = dp.auditing.check_sensitivity(model, rng.randint(0, 7, (20, 5)),
                                           rng.randint(0, 3, 20), policy=policy,
                                           batch_size=6, num_candidates=6)
  assert report.passed, str(report)
  assert report.measured_sensitivity > 0.0
  # add/remove: S = 1; replace one: 2S
  assert report.recorded_sensitivity == pytest.approx(1.0 if policy == "poisson" else 2.0)


def test_integer_candidates_stay_in_the_observed_range():
  x = np.random.RandomState(1).randint(3, 9, (10, 4)).astype("int32")
  cands = _candidates(np.random.RandomState(0), x, np.arange(10) % 2, 12)
  assert len(cands) == 12
  for xc, _, what in cands:
    assert xc.dtype == np.int32 and xc.shape == (4,)
    assert xc.min() >= 3 and xc.max() <= 8, what
  wider = _candidates(np.random.RandomState(0), x, np.arange(10) % 2, 12, id_range=(0, 20))
  assert max(int(xc.max()) for xc, _, _ in wider) > 8   # the given range is used
  floats = _candidates(np.random.RandomState(0), x.astype("float32"), np.arange(10) % 2, 6)
  assert any(xc.min() < 0 for xc, _, _ in floats)   # float candidates unchanged (negated)
