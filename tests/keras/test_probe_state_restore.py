"""The probes' state restore (batch_independence._state_restored) restores the
non-trainable variables their runs change (dropout's seed state) and leaves the others alone:
a frozen backbone's weights are neither copied nor assigned (a numpy copy of BERT-base's
frozen weights under LoRA took 420 MB of the DP fit's peak memory)."""

import keras
import numpy as np
import tensorflow as tf

from tf_dpiter.keras.internals import batch_independence as bi


def _mixes_in_training_mode(model, x):
  """Whether `model` run in training mode on `x` and on `x` with its last example replaced
  (`_two_runs`: both from the same state, restored after) moves another example's output."""
  flat, n = bi._at_graph_batch(bi._graph_nodes(model), [np.asarray(t) for t in tf.nest.flatten(x)])  # pylint: disable=protected-access
  x1 = tf.nest.pack_sequence_as(x, flat)
  x2 = tf.nest.pack_sequence_as(x, [bi._replace_last(t, 1) for t in flat])  # pylint: disable=protected-access
  out1, out2 = bi._two_runs(model, x1, x2, True)  # pylint: disable=protected-access
  return any(bi._rows_moved(np.asarray(a), np.asarray(b), n, 1e-6)  # pylint: disable=protected-access
             for a, b in zip(tf.nest.flatten(out1), tf.nest.flatten(out2)))


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
  assert _mixes_in_training_mode(model, x) is False
  assert assigned == []
  after = [v.numpy() for v in model.non_trainable_variables]
  assert len(before) == len(after) and len(before) >= 3   # kernel, bias, the seed state
  for b, a in zip(before, after):
    np.testing.assert_array_equal(a, b)


class _Counter(keras.layers.Layer):
  """Counts its training calls in a non-trainable variable (written by each probe run)."""

  def build(self, input_shape):
    self.count = self.add_weight(shape=(), initializer="zeros", trainable=False, name="count")

  def call(self, x, training=None):
    if training:
      self.count.assign_add(1.0)
    return x


def test_probe_compares_only_the_variables_its_runs_wrote(monkeypatch):
  """A variable whose read still shares the buffer saved before the runs was not written
  (a write makes a new buffer): the frozen kernel is not compared; the counter, written by
  each run, is compared and assigned back; the seed state is restored."""
  keras.utils.set_random_seed(0)
  inp = keras.Input((5,))
  frozen = keras.layers.Dense(6)
  counter = _Counter()
  h = keras.layers.Dropout(0.5, seed=3)(counter(frozen(inp)))
  model = keras.Model(inp, keras.layers.Dense(2)(h))
  frozen.trainable = False
  before = [np.array(v.numpy()) for v in model.non_trainable_variables]
  compared = []
  real_equal = tf.equal
  monkeypatch.setattr(tf, "equal",
                      lambda a, b, **kw: compared.append(tuple(a.shape)) or real_equal(a, b, **kw))
  x = np.random.RandomState(0).randn(4, 5).astype("float32")
  assert _mixes_in_training_mode(model, x) is False
  assert (5, 6) not in compared and (6,) not in compared   # the frozen kernel and bias
  assert () in compared                                     # the counter
  after = [v.numpy() for v in model.non_trainable_variables]
  for b, a in zip(before, after):
    np.testing.assert_array_equal(a, b)
  assert float(counter.count.numpy()) == 0.0
