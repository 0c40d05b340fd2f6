"""A batch unknown to the trace (fit's sampled datasets) keeps the positions static.

The rules choose their forms by static sizes: factored_sqr_norm takes the Gram form only
when T is known. A reshape to [B, -1, K] with B unknown left T unknown, so every Dense on a
sequence materialized per-example gradients in fit (14M floats per step for the LSTM
language model's output layer). The flattening helpers must keep T static.
"""

import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping.rules import tables


def test_to_btk_and_flat_ids_keep_static_positions_under_an_unknown_batch():
  seen = {}

  @tf.function(input_signature=[tf.TensorSpec([None, 5, 3, 7]), tf.TensorSpec([None, 5, 3],
                                                                              tf.int32)])
  def trace(x, ids):
    seen["btk"] = algebra.to_btk(x).shape.as_list()
    seen["ids"] = tables.flat_ids(ids).shape.as_list()
    return tf.constant(0)

  trace.get_concrete_function()
  assert seen == {"btk": [None, 15, 7], "ids": [None, 15]}


def test_gram_form_chosen_for_a_wide_dense_on_sequences_under_an_unknown_batch():
  forms = []
  gram = algebra.gram_sqr_norm

  @tf.function(input_signature=[tf.TensorSpec([None, 40, 128]), tf.TensorSpec([None, 40, 2000])])
  def norms(a, b):
    calls = []
    algebra.gram_sqr_norm = lambda *args, **kw: calls.append(1) or gram(*args, **kw)
    try:
      sq, g = algebra.factored_sqr_norm(algebra.to_btk(a), algebra.to_btk(b))   # the Dense rule
    finally:
      algebra.gram_sqr_norm = gram
    forms.append(("gram" if calls else "direct", g is None))
    return sq

  with algebra.examples_per_record(1):
    norms.get_concrete_function()
  assert forms == [("gram", True)]
