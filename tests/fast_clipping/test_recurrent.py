"""Ghost norms of recurrent layers (issue 14): SimpleRNN, LSTM, GRU (both
reset_after variants), Bidirectional, unroll=False, against a per-record loop.

Noise 0; the reference runs each record alone and clips in float64
(conftest.per_record_clipped_sum). Tolerances: float32 round-off, relative 1e-5
on norms and 1e-5 of the largest entry on the clipped sums (the recurrence of
T <= 7 steps with tanh/sigmoid gates adds no amplification beyond that).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.keras import fast_clipping as fc
from tf_dpiter.keras.fast_clipping import clipping

L = keras.layers
B, T, VOCAB = 6, 7, 9
RTOL = 1e-5


def token_loss(y_true, y_pred):
  """Per-record loss: the mean over tokens of a per-token cross-entropy."""
  per_token = keras.losses.sparse_categorical_crossentropy(
      y_true, tf.cast(y_pred, tf.float32), from_logits=True)
  return tf.reduce_mean(per_token, axis=-1)


def last_loss(y_true, y_pred):
  return keras.losses.sparse_categorical_crossentropy(
      y_true, tf.cast(y_pred, tf.float32), from_logits=True)


def lm(rnn, mask_zero=False):
  """Embedding -> rnn (return_sequences) -> per-token logits."""
  keras.utils.set_random_seed(3)
  inp = keras.Input((T,), dtype="int32")
  h = L.Embedding(VOCAB, 4, mask_zero=mask_zero)(inp)
  h = rnn(h)
  return keras.Model(inp, L.Dense(VOCAB)(h))


def classifier(rnn):
  keras.utils.set_random_seed(3)
  inp = keras.Input((T, 3))
  return keras.Model(inp, L.Dense(4)(rnn(inp)))


def tokens(seed, pad=False):
  rng = np.random.default_rng(seed)
  x = rng.integers(1, VOCAB, (B, T)).astype("int32")
  if pad:   # right-padded sequences of lengths T, T-1, ..., T-B+1
    for i in range(B):
      x[i, T - i:] = 0
  return tf.constant(x), tf.constant(rng.integers(0, VOCAB, (B, T)).astype("int32"))


def check(model, x, y, loss_fn, ref_fn, k=1, mask=None, variants=("bookkeeping", "two_pass")):
  assert fc.unregistered_layers(model) == []
  memo = {}   # each record's loop gradient once for both calls
  _, norms = ref_fn(model, x, y, loss_fn, 1.0, k, mask, memo=memo)
  clip = float(np.median(norms[norms > 0]))   # some records clipped, some not
  ref, ref_norms = ref_fn(model, x, y, loss_fn, clip, k, mask, memo=memo)
  for variant in variants:
    grads, got = clipping.clipped_grad_sum(
        model, x, y, loss_fn, clip, mask=mask, variant=variant, examples_per_record=k)
    np.testing.assert_allclose(got.numpy(), ref_norms, rtol=RTOL, atol=1e-7)
    for g, r, v in zip(grads, ref, model.trainable_variables):
      scale = max(float(np.max(np.abs(r))), 1e-3)
      np.testing.assert_allclose(np.asarray(g), r, atol=RTOL * scale, err_msg=f"{variant} {v.path}")


LM_CASES = {
    "simple_rnn": lambda: L.SimpleRNN(5, return_sequences=True),
    "lstm": lambda: L.LSTM(5, return_sequences=True),
    "lstm_nobias_unrolled": lambda: L.LSTM(5, return_sequences=True, use_bias=False, unroll=True),
    "gru_reset_after": lambda: L.GRU(5, return_sequences=True),
    "gru_reset_before_backwards": lambda: L.GRU(5, return_sequences=True, reset_after=False,
                                                go_backwards=True),
    "bidirectional_lstm": lambda: L.Bidirectional(L.LSTM(4, return_sequences=True)),
    "bidirectional_gru_concat_sum": lambda: L.Bidirectional(
        L.GRU(4, return_sequences=True, reset_after=False), merge_mode="sum"),
}


# Default suite: the masked LSTM language model (book-keeping); the rest -m slow.
DEFAULT_LM = {("lstm", True)}
LM_PARAMS = [pytest.param(name, pad, marks=() if (name, pad) in DEFAULT_LM else pytest.mark.slow,
                          id=f"{name}-{'masked' if pad else 'full'}")
             for name in LM_CASES for pad in (False, True)]


@pytest.mark.parametrize("name,pad", LM_PARAMS)
def test_language_model_per_token_loss_exact(name, pad, clip_reference):
  model = lm(LM_CASES[name](), mask_zero=pad)
  x, y = tokens(0, pad)
  slow = (name, pad) not in DEFAULT_LM
  check(model, x, y, token_loss, clip_reference,
        variants=("bookkeeping", "two_pass") if slow else ("bookkeeping",))


CLASSIFIER_CASES = {
    "simple_rnn_last": lambda: L.SimpleRNN(5, activation="relu"),
    "lstm_last_backwards": lambda: L.LSTM(5, go_backwards=True),
    "gru_last": lambda: L.GRU(5),
    "gru_reset_before_last": lambda: L.GRU(5, reset_after=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CLASSIFIER_CASES))
def test_last_output_exact(name, clip_reference):
  model = classifier(CLASSIFIER_CASES[name]())
  rng = np.random.default_rng(1)
  x = tf.constant(rng.normal(size=(B, T, 3)), tf.float32)
  y = tf.constant(rng.integers(0, 4, B), tf.int32)
  check(model, x, y, last_loss, clip_reference, variants=("bookkeeping",))


@pytest.mark.slow
def test_return_state_and_stacked_layers_exact(clip_reference):
  keras.utils.set_random_seed(3)
  inp = keras.Input((T, 3))
  seq, h, c = L.LSTM(4, return_sequences=True, return_state=True)(inp)
  out = L.GRU(4)(seq, initial_state=h)
  model = keras.Model(inp, L.Dense(4)(L.Concatenate()([out, c])))
  rng = np.random.default_rng(2)
  x = tf.constant(rng.normal(size=(B, T, 3)), tf.float32)
  y = tf.constant(rng.integers(0, 4, B), tf.int32)
  check(model, x, y, last_loss, clip_reference, variants=("bookkeeping",))


@pytest.mark.parametrize("k", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_microbatch_records_with_mask_exact(k, clip_reference):
  model = lm(L.LSTM(5, return_sequences=True), mask_zero=True)
  x, y = tokens(4, pad=True)
  mask = np.array([1, 1, 0, 1, 0, 1], np.float32)
  check(model, x, y, token_loss, clip_reference, k=k, mask=mask, variants=("bookkeeping",))


def test_dropout_is_refused_and_vectorized_layers_stay_exact():
  model = lm(L.LSTM(5, return_sequences=True, dropout=0.2))
  assert not fc.supports(model)   # unregistered path would re-run the dropout
  with pytest.raises(ValueError, match="dropout"):
    fc.clipped_grad_sum(model, *tokens(0), token_loss, 1.0)


def test_auto_routes_lstm_language_model_to_fast_path():
  model = dp.keras.make_private(lm(L.LSTM(5, return_sequences=True)))
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=token_loss)
  assert model.optimizer.resolve_clipping(model) == "fast"


@pytest.mark.slow
def test_fit_sensitivity_under_remove_one_on_fast_path():
  """Relation add/remove one example (Poisson); the real train step, noise 0."""
  from tf_dpiter.auditing import sensitivity  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(3)
  model = dp.keras.DPSequential([keras.Input((T, 3)), L.GRU(4), L.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(0.1, 1.1, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.RandomState(0)
  x, y = rng.randn(16, T, 3).astype("float32"), rng.randint(0, 3, 16)
  report = sensitivity.check_sensitivity(model, x, y, num_candidates=5)
  assert report.path == "fast", str(report)
  assert report.passed and report.measured_sensitivity > 0.05, str(report)
