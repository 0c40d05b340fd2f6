"""The training-mode probe (batch_independence.mixes_in_training_mode) restores the
non-trainable variables its runs change (dropout's seed state) and leaves the others alone:
a frozen backbone's weights are neither copied nor assigned (a numpy copy of BERT-base's
frozen weights under LoRA took 420 MB of the DP fit's peak memory)."""

import keras
import numpy as np

from tf_dpiter.keras.internals import batch_independence


def test_probe_restores_changed_state_and_does_not_assign_frozen_weights():
  keras.utils.set_random_seed(0)
  inp = keras.Input((5,))
  frozen = keras.layers.Dense(6)
  h = keras.layers.Dropout(0.5, seed=3)(frozen(inp))
  model = keras.Model(inp, keras.layers.Dense(2)(h))
  frozen.trainable = False
  before = [np.array(v.numpy()) for v in model.non_trainable_variables]
  assigned = []
  for v in frozen.weights:
    original = v.assign
    v.assign = lambda value, _orig=original, _v=v: assigned.append(_v.path) or _orig(value)
  x = np.random.RandomState(0).randn(4, 5).astype("float32")
  assert batch_independence.mixes_in_training_mode(model, x) is False
  assert assigned == []
  after = [v.numpy() for v in model.non_trainable_variables]
  assert len(before) == len(after) and len(before) >= 3   # kernel, bias, the seed state
  for b, a in zip(before, after):
    np.testing.assert_array_equal(a, b)
