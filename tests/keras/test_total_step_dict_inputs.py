"""Review R6, finding 6 (fixed): total_records.guard_embedding_ids matches the model's input positions
(functional.inputs, a list) against tf.nest.flatten(x); a dict batch flattens by sorted key,
so for a model built on a list of inputs and fit on a dict keyed by the inputs' names (which
Keras accepts) the guard tests the wrong input: the real ids go unguarded and a float feature
is tested against [0, input_dim).

Claim (CHANGELOG session 36: "Private steps no longer stop on one record's value ... an id
outside an Embedding's vocabulary (an Embedding fed by a model input) makes that example
contribute zero"). Pair (replace one example, fit's "shuffle"; unit = example): ids[0, 0] = 7
on D (input_dim 5), 0 on D'. Measured at b8ec6ae: D's fit stops with InvalidArgumentError
at the Embedding's GatherV2, D''s runs; and on valid batches 7 of 10 examples were masked
(those with a negative feature), silently.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras.internals import total_records


def _model():
  ids = keras.Input((3,), name="ids", dtype="int32")
  feats = keras.Input((2,), name="a_feats")
  h = keras.layers.Flatten()(keras.layers.Embedding(5, 2)(ids))
  out = keras.layers.Dense(1)(keras.layers.Concatenate()([h, feats]))
  return dp.keras.DPModel([ids, feats], out)


def _data():
  rng = np.random.default_rng(0)
  return (rng.integers(0, 5, size=(40, 3)).astype("int32"),
          rng.normal(size=(40, 2)).astype("float32"), rng.normal(size=(40, 1)).astype("float32"))



def test_the_guard_reads_the_ids_of_a_dict_batch():
  ids, feats, _ = _data()
  _, valid = total_records.guard_embedding_ids(
      _model(), {"ids": tf.constant(ids[:10]), "a_feats": tf.constant(feats[:10])})
  np.testing.assert_array_equal(valid.numpy(), np.ones(10, np.float32))



def test_an_out_of_vocabulary_id_in_a_dict_batch_does_not_stop_the_fit():
  ids, feats, y = _data()
  ids[0, 0] = 7   # D: outside input_dim 5
  keras.utils.set_random_seed(0)
  model = _model()
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  model.fit({"ids": ids, "a_feats": feats}, y, batch_size=10, epochs=1, verbose=0,
            sampling="shuffle")
  assert int(model.optimizer.iterations.numpy()) == 4
