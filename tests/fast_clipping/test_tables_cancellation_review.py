"""Review: lookup tables under cancellation, and ReversibleEmbedding used both ways.

keras_hub's PositionEmbedding adds the same rows P[start:start+T] to every example, like a
bias of shape [T, D]: a record's gradient of P is sum over its k examples (and over the axes
between the batch and the sequence axis, on a rank-4 input) of the output gradients dz. Its
rule (rules/keras_hub.py) took the norm of that float32 sum, while the clipped sum is the
vector-Jacobian product of the broadcast with c dz (every term rounded again): two examples
of one record with output gradients -L w and L (1 + 2^-23) w (the table at 0 and a frozen
head w, labels +-L: the exact gradient 2^-23 L w, its float32 parts L w) made the norm mostly
rounding, and one record moved the noise-off clipped sum by up to 1.22 C (XLA) / 1.18 C
(graph) at db14de0; on a rank-4 input with head w and -w (1 + 2^-23) on the two rows of the
middle axis the same within one example. Fixed by P (algebra.bias_sqr_norm with the table's
[T, D] as the bias shape): 0.09 .. 0.18 C. Explicit positions (rules/tables.py) held.

Embedding (same ids read by both examples of a record, the same labels) and
ReversibleEmbedding's lookup go through rules/tables.same_id_sqr_norm (an upper bound): they
hold. ReversibleEmbedding tied and called both ways in one model (the lookup and the output
projection): the unit is called twice, so its per-record gradient is the sum of both calls'
exact per-example gradients (the cross term in the norm): the norms are checked against an
independent float64 copy of the model.
"""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from .covers import all_pairs
from .covers import assert_covers_pairs_of
from .covers import slow_outside
from .test_gram_cancellation_review import _contributions
from .test_layer_cancellation_review import _assert_within_c
from .test_layer_zoo_review import assert_upper_bound
from .test_layer_zoo_review import exact_norms
from .test_layer_zoo_review import fast_norms

# Nightly tier (-m slow): by default every value of each parameter, graph and XLA, at least
# once (a diagonal of the product); the comment of each id group names the cases that stay.
SLOW_CASES = {
    # test_position_embedding_records_of_two: [False-True], [True-False] stay by default
    "test_position_embedding_records_of_two[False-False]",
    "test_position_embedding_records_of_two[True-True]",
    # test_same_id_records_of_two: [embedding-True], [reversible_lookup-False] stay by default
    "test_same_id_records_of_two[embedding-False]",
    "test_same_id_records_of_two[reversible_lookup-True]",
}

L = keras.layers
T, D = 4, 32


def _head(z, w):
  head = L.Dense(1, use_bias=False, trainable=False)
  out = head(L.Flatten()(z))
  head.kernel.assign(w.reshape(-1, 1).astype("float32"))
  return out


def _mirrored_labels(rng, count):
  """Records of two examples with labels L and -L (1 + 2^-23), L 1e5 .. 1e7: output
  gradients -L w and L (1 + 2^-23) w from an output of exactly 0."""
  ys = []
  for _ in range(count):
    big = np.float32(10.0 ** rng.uniform(5, 7))
    ys += [[big], [-np.nextafter(big, 2 * big)]]
  return np.array(ys, np.float32)


def _position_model(shape, w, **call):
  """Input `shape` -> PositionEmbedding(T) (the table at 0: the output exactly 0) -> the
  frozen head of weights w."""
  keras.utils.set_random_seed(0)
  inp = keras.Input(shape)
  pos = keras_hub.layers.PositionEmbedding(T)
  model = keras.Model(inp, _head(pos(inp, **call), w))
  pos.position_embeddings.assign(np.zeros((T, D), np.float32))
  return model


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("explicit", [False, True])
def test_position_embedding_records_of_two(explicit, jit):
  """explicit: positions [T] given (a permutation): the table-lookup norm (rules/tables.py)."""
  call = {"positions": tf.constant([2, 0, 3, 1])} if explicit else {}
  model = _position_model((T, D), np.random.RandomState(1).normal(size=T * D), **call)
  y = _mirrored_labels(np.random.RandomState(3), 16)
  _assert_within_c(_contributions(model, np.zeros((32, T, D), np.float32), y, jit, k=2))


@pytest.mark.parametrize("jit", [False, True])
def test_position_embedding_rank_4_cancelling_rows(jit):
  """Input [B, 2, T, D]: the table broadcast over the middle axis, head w on its row 0 and
  -w (1 + 2^-23) on row 1; one example per record."""
  w = np.random.RandomState(1).normal(size=T * D).astype("float32")
  model = _position_model((2, T, D), np.concatenate([w, -np.nextafter(w, 2 * w)]))
  y = (10.0 ** np.random.RandomState(3).uniform(5, 7, (16, 1))).astype(np.float32)
  _assert_within_c(_contributions(model, np.zeros((16, 2, T, D), np.float32), y, jit))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("kind", ["embedding", "reversible_lookup"])
def test_same_id_records_of_two(kind, jit):
  """Both examples of a record read id 3 at every position; the same mirrored labels."""
  keras.utils.set_random_seed(0)
  inp = keras.Input((T,), dtype="int32")
  table = (L.Embedding(10, D) if kind == "embedding" else
           L.ReversibleEmbedding(10, D, tie_weights=True))
  w = np.random.RandomState(1).normal(size=T * D)
  model = keras.Model(inp, _head(table(inp), w))
  variable = table.embeddings
  variable.assign(np.zeros(variable.shape, np.float32))
  y = _mirrored_labels(np.random.RandomState(3), 16)
  _assert_within_c(_contributions(model, np.full((32, T), 3, np.int32), y, jit, k=2))


def _tied_lm(dtype, soft_cap=None):
  keras.utils.set_random_seed(1)
  inp = keras.Input((T,), dtype="int32")
  rev = L.ReversibleEmbedding(11, 6, tie_weights=True, logit_soft_cap=soft_cap, dtype=dtype)
  h = L.Dense(6, activation="tanh", dtype=dtype)(rev(inp))
  logits = rev(h, reverse=True)
  return keras.Model(inp, L.Dense(1, dtype=dtype)(L.Flatten(dtype=dtype)(logits)))


# (soft cap, k, jit): by default an all-pairs cover (each soft cap with records of 1 and 2, in
# graph and under XLA), the rest marked slow
TIED = [(cap, k, jit) for cap in (None, 3.0) for k in (1, 2) for jit in (False, True)]
TIED_DEFAULT = all_pairs(TIED)


def test_default_cases_cover_every_pair():
  assert_covers_pairs_of(TIED_DEFAULT, TIED)
  assert len(TIED_DEFAULT) == 4


@pytest.mark.parametrize("soft_cap,k,jit", slow_outside(TIED, TIED_DEFAULT))
def test_tied_reversible_embedding_both_ways(soft_cap, k, jit):
  model, model64 = _tied_lm("float32", soft_cap), _tied_lm("float64", soft_cap)
  model64.set_weights(model.get_weights())
  rng = np.random.RandomState(0)
  x = rng.randint(0, 11, (8, T)).astype("int32")
  out = model64(x).numpy()
  y = (out - np.sign(rng.normal(size=out.shape)) * (100 * np.abs(out) + 1)).astype("float32")
  assert_upper_bound(fast_norms(model, x, y, jit, k), exact_norms(model64, x, y, k))
