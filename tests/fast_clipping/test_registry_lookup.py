"""registry.lookup_all (one lookup per plan, hooks run once) and algebra.RECORDS (the k of
the enclosing examples_per_record context)."""

import threading

import keras

from tf_dpiter.keras import fast_clipping
from tf_dpiter.keras.fast_clipping import plan as plan_lib
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry


class _Custom(keras.layers.Dense):
  def call(self, inputs):   # overrides call: does not inherit Dense's rule
    return super().call(inputs) * 2.0


def test_lookup_all_gives_each_layers_rule_and_runs_the_hooks_once():
  layers = [keras.layers.Dense(2), keras.layers.Dropout(0.1), _Custom(3),
            keras.layers.Embedding(4, 2)]
  calls = []
  registry.add_lookup_hook(lambda: calls.append(1))
  try:
    rules = registry.lookup_all(layers)
    assert len(calls) == 1
  finally:
    registry._LOOKUP_HOOKS.pop()   # pylint: disable=protected-access
  assert rules == {id(layer): registry.lookup(layer) for layer in layers}
  assert rules[id(layers[0])] is not None and rules[id(layers[1])] is None
  assert rules[id(layers[2])] is None


def test_plan_looks_up_the_rules_once():
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
  seen = []
  registry.add_lookup_hook(lambda: seen.append(1))
  try:
    units = plan_lib.plan(model)
  finally:
    registry._LOOKUP_HOOKS.pop()   # pylint: disable=protected-access
  assert len(seen) == 1
  assert [u.kind for u in units] == [plan_lib.GHOST, plan_lib.GHOST]
  assert fast_clipping.supports(model)


def test_records_k_is_the_enclosing_context_and_per_thread():
  assert algebra.RECORDS.k == 1 == algebra.current_examples_per_record()
  other = []
  with algebra.examples_per_record(3):
    assert algebra.RECORDS.k == 3 == algebra.current_examples_per_record()
    t = threading.Thread(target=lambda: other.append(algebra.RECORDS.k))
    t.start()
    t.join()
    with algebra.examples_per_record(5):
      assert algebra.RECORDS.k == 5
    assert algebra.RECORDS.k == 3
  assert algebra.RECORDS.k == 1
  assert other == [1]
