"""What the private step reads once per train function (its trace facts) and once per step
(the fast-clipping plan): reused while valid, read afresh when it may have changed, and what
decides privacy (a trainable BatchNormalization, the trained variables) read every step."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.fast_clipping import plan as plan_lib

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(extra=()):
  keras.utils.set_random_seed(0)
  return dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                                *extra, keras.layers.Dense(3)])


def _compile(model, clipping="vectorized"):
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1, clipping=clipping)
  opt.set_sampling(64, 8 / 64, "poisson", 8)
  model.compile(optimizer=opt, loss=LOSS, run_eagerly=True)
  return opt


def _batch():
  rng = np.random.RandomState(0)
  return rng.randn(8, 6).astype("float32"), rng.randint(0, 3, 8)


def test_facts_reused_then_rebuilt_on_recompile():
  model = _model()
  _compile(model)
  x, y = _batch()
  model.train_on_batch(x, y)
  facts = model._dp_trace_facts()   # pylint: disable=protected-access
  model.train_on_batch(x, y)
  assert model._dp_trace_facts() is facts   # pylint: disable=protected-access
  opt = _compile(model)   # a new compile and optimizer: read afresh
  model.train_on_batch(x, y)
  again = model._dp_trace_facts()   # pylint: disable=protected-access
  assert again is not facts and again.optimizer is opt


def test_batch_norm_made_trainable_after_a_step_is_refused():
  bn = keras.layers.BatchNormalization()
  model = _model([bn])
  bn.trainable = False   # frozen (inference mode): allowed
  _compile(model)
  x, y = _batch()
  model.train_on_batch(x, y)
  bn.trainable = True   # the facts of this train function are cached; the flag is read per step
  with pytest.raises(PrivacyConfigError, match="BatchNormalization"):
    model.train_on_batch(x, y)


def test_plan_reused_within_a_step_only():
  model = _model()
  model.build((None, 6))
  with plan_lib.one_plan_per_step():
    first, second = plan_lib.plan(model), plan_lib.plan(model)
    # the same split, in new Unit objects (a clipped sum records into its units)
    assert [(u.layer, u.kind) for u in first] == [(u.layer, u.kind) for u in second]
    assert all(a is not b for a, b in zip(first, second))
  model.layers[0].trainable = False   # between steps: the next plan sees it
  units = plan_lib.plan(model)
  assert [u.layer for u in units] == [model.layers[1]]
  assert {id(v) for u in units for v in u.variables} == {
      id(v) for v in model.trainable_variables}
