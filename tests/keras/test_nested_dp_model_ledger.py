"""A DP-trained model fine-tuned inside another DP model: the outer ledger charges its steps.

Relation and unit: add or remove one example (Poisson), the same private data in both
phases. The backbone's weights went through its own run's steps (10 here), so the outer
model's released weights are covered only by a ledger holding them and the fine-tuning's
(12: 10 at q = 0.1 and 2, composed). The outer compile (and every fit) adopts the ledgers of
nested DP models: the one their weights file carried and their own DP optimizer's; the nested
model's optimizer hands its variables over, so training it on its own again is refused."""

import functools
import os
import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.errors import PrivacyConfigError

DELTA = 1e-5


def _backbone():
  i = keras.Input((2,))
  return dp.keras.DPModel(i, keras.layers.Dense(3, name="feat")(i), name="backbone")


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(40, 2)).astype(np.float32),
          rng.normal(size=(40, 1)).astype(np.float32))


def _pretrained():
  x, y = _data()
  keras.utils.set_random_seed(0)
  pre = _backbone()
  pre.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.01), loss="mse")
  pre.fit(x, np.repeat(y, 3, 1), batch_size=4, epochs=1, verbose=0)   # 10 steps, q = 0.1
  assert int(pre.ledger.sample_count.numpy()) == 10
  return pre


@functools.lru_cache(maxsize=None)
def _shared_pretrained():
  """`_pretrained()` once per process, for the cases that only save it (its weights file or
  model file then loaded into a backbone of their own)."""
  return _pretrained()


def _fine_tune(backbone):
  x, y = _data()
  i = keras.Input((2,))
  outer = dp.keras.DPModel(i, keras.layers.Dense(1)(backbone(i)))
  outer.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.01),
                loss="mse")
  outer.fit(x, y, batch_size=4, epochs=1, steps_per_epoch=2, verbose=0)
  return outer


def _by_hand():
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)),
                                      12))
  return acc.get_epsilon(DELTA)


def _check(outer):
  assert int(outer.ledger.sample_count.numpy()) == 12
  assert dp.accounting.epsilon(outer.ledger, DELTA) >= _by_hand() - 1e-9


@pytest.mark.parametrize("how", ["load_weights", "load_model"])
def test_a_loaded_dp_backbone_keeps_its_ledger(tmp_path, how):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pre = _shared_pretrained()
    if how == "load_weights":
      path = os.path.join(tmp_path, "backbone.weights.h5")
      pre.save_weights(path)
      backbone = _backbone()
      backbone.load_weights(path)
    else:
      path = os.path.join(tmp_path, "backbone.keras")
      pre.save(path)
      backbone = keras.models.load_model(path)
    _check(_fine_tune(backbone))


def test_an_in_process_backbone_is_taken_over():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pre = _pretrained()
    outer = _fine_tune(pre)   # pre's optimizer is alive: its ledger and variables move over
    _check(outer)
    x, y = _data()
    with pytest.raises(PrivacyConfigError, match="feat/kernel.*another DP optimizer"):
      pre.fit(x, np.repeat(y, 3, 1), batch_size=4, epochs=1, verbose=0)
    assert int(pre.ledger.sample_count.numpy()) == 10
    outer.fit(x, y, batch_size=4, epochs=1, steps_per_epoch=2, verbose=0)
    assert int(outer.ledger.sample_count.numpy()) == 14
