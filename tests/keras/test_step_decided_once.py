"""What a DP step decides once and keeps: the clipping path per train function and input
shape (PrivateStep.resolve_clipping), the sampling's policy and sensitivity factor per
declaration (ledger.LedgerSampling), a LoRA-capable layer's rule per plan
(fast_clipping.registry.lookup_all), the fast-clipping plan per train function while the
trainable variables and the registered rules stay the same (fast_clipping.plan)."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import ledger as ledger_lib
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.keras.fast_clipping import plan as plan_lib
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import dense as dense_rules
from tf_dpiter.keras.fast_clipping.rules import lora as lora_rules
from tf_dpiter.keras.optimizer import routing
from tf_dpiter.ledger import policies

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(clipping="auto"):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                                 keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1,
                                                       clipping=clipping),
                loss=LOSS, run_eagerly=True)
  model.optimizer.set_sampling(64, 8 / 64, "poisson", 8)
  return model


def _spy(monkeypatch):
  calls = []
  real = routing.fast_path_obstacle

  def spy(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)

  monkeypatch.setattr(routing, "fast_path_obstacle", spy)
  return calls


def test_the_path_is_decided_once_per_train_function_and_input_shape(monkeypatch):
  calls = _spy(monkeypatch)
  model = _model()
  rng = np.random.RandomState(0)
  x, y = rng.randn(8, 6).astype("float32"), rng.randint(0, 3, 8)
  for _ in range(3):
    model.train_on_batch(x, y)
  assert len(calls) == 1 and model._dp_traced_clipping == "fast"  # pylint: disable=protected-access
  model.train_on_batch(x[:5], y[:5])   # a new input shape: decided again (a new trace)
  assert len(calls) == 2
  model.compile(optimizer=model.optimizer, loss=LOSS, run_eagerly=True)   # a new train function
  model.train_on_batch(x, y)
  assert len(calls) == 3
  model.get_layer(index=0).trainable = False   # other trainable variables: decided again
  model.train_on_batch(x, y)
  assert len(calls) == 4
  assert int(model.optimizer.iterations.numpy()) == int(model.ledger.sample_count.numpy()) == 6


def test_direct_calls_outside_a_train_function_are_not_kept(monkeypatch):
  calls = _spy(monkeypatch)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1), loss=LOSS)
  assert model.optimizer.resolve_clipping(model) == "fast"
  assert model.optimizer.resolve_clipping(model) == "fast"
  assert len(calls) == 2


def test_ledger_sampling_resolves_its_policy_once(monkeypatch):
  event = events_lib.GaussianSumEvent(l2_norm_clip=1.5, stddev=2.0)
  by_hand = ledger_lib.PrivacyLedger()
  by_hand.record_sample(100.0, 0.25, (event,), policy="shuffle", sample_size=25.0,
                        examples_per_record=4)
  sampling = ledger_lib.LedgerSampling(100.0, 0.25, policy="shuffle", sample_size=25.0,
                                       examples_per_record=4)
  looked_up = []
  real_get = policies.get
  monkeypatch.setattr(policies, "get", lambda name: looked_up.append(name) or real_get(name))
  sampling.record((event,))
  assert looked_up == []
  for a, b in zip(sampling.ledger.get_arrays(), by_hand.get_arrays()):
    np.testing.assert_array_equal(a, b)
  # microbatches of 4 under replace-one: sensitivity 2 S, as records.sensitivity_factor says
  assert sampling.ledger.get_arrays()[1][0, -1] == 2 * 1.5
  with pytest.raises(dp.errors.PrivacyConfigError, match="examples_per_record=4"):
    ledger_lib.LedgerSampling(100.0, 0.25, policy="poisson", examples_per_record=4)


def test_a_lora_capable_layer_gets_the_rule_of_its_setting():
  plain, with_lora = keras.layers.Dense(4), keras.layers.Dense(4)
  plain.build((None, 3))
  with_lora.build((None, 3))
  with_lora.enable_lora(2)
  rules = registry.lookup_all([plain, with_lora])
  assert rules[id(plain)] is dense_rules.dense_norm_fn
  assert rules[id(with_lora)] is lora_rules.dense_lora_norm_fn
  assert registry.lookup(with_lora) is lora_rules.dense_lora_norm_fn


def test_the_plan_is_kept_per_train_function_until_what_it_reads_changes(monkeypatch):
  built = []
  real = registry.lookup_all   # runs once per plan built (not for a kept one)
  monkeypatch.setattr(registry, "lookup_all", lambda layers: built.append(1) or real(layers))
  model = _model("fast")
  rng = np.random.RandomState(0)
  x, y = rng.randn(8, 6).astype("float32"), rng.randint(0, 3, 8)
  for _ in range(3):
    model.train_on_batch(x, y)
  assert len(built) == 1
  first = model.get_layer(index=0)
  first.trainable = False   # other trainable variables: planned again, without the layer
  model.train_on_batch(x, y)
  assert len(built) == 2
  units = plan_lib.plan(model)   # outside a train step: built, not kept
  assert [u.layer for u in units] == [model.get_layer(index=1)] and len(built) == 3
  first.trainable = True
  model.train_on_batch(x, y)
  assert len(built) == 4
  # a rule registered between steps (here the same one again): planned again
  monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # pylint: disable=protected-access
  registry.register_layer(keras.layers.Dense, dense_rules.dense_norm_fn)
  model.train_on_batch(x, y)
  assert len(built) == 5
  model.compile(optimizer=model.optimizer, loss=LOSS, run_eagerly=True)   # a new train function
  model.train_on_batch(x, y)
  assert len(built) == 6
  assert int(model.optimizer.iterations.numpy()) == int(model.ledger.sample_count.numpy()) == 7
