"""The sequence rules' memory budget (rules/budget.py, issue 42): Dense and EinsumDense on
[B, T, d] inputs, Embedding, LayerNormalization, attention and LSTM / GRU, with the batch
split into chunks (budget.CHUNK_BYTES set to 1 byte: chunks of 8 examples, the last one
padded) and the per-record gradients kept or not (budget.KEEP_BYTES), against the per-record
reference loop (conftest.per_record_clipped_sum, float64), with and without jit_compile, with
a batch the trace knows or not, records masked out (c = 0) and a record whose values are not
finite (c = 0, adds nothing). Tolerances: float32 round-off (relative 1e-4 on norms, 1e-4 of
the largest entry on the sums)."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping.rules import budget

# Nightly tier (-m slow, besides the marks below): the non-finite record with kept
# gradients (without them stays: the same zero contribution).
SLOW_CASES = {
    "test_non_finite_record_adds_nothing[True-False]"}

L = keras.layers
B, T = 19, 6   # 19 = 2 chunks of 8 and a padded one


def _attention_model():
  """Float [T, 5] inputs -> Dense -> self-attention (EinsumDense) + LayerNorm -> Dense per
  token on [B, T, d] (bias folded; then without bias) -> pooled logits."""
  keras.utils.set_random_seed(4)
  inp = keras.Input((T, 5))
  h = L.Dense(8)(inp)
  h = L.LayerNormalization()(h + L.MultiHeadAttention(num_heads=2, key_dim=4)(h, h))
  h = L.Dense(12, activation="relu")(h)
  h = L.Dense(8, use_bias=False)(h)
  return keras.Model(inp, L.Dense(3)(L.GlobalAveragePooling1D()(h)))


def _lm(rnn):
  keras.utils.set_random_seed(5)
  inp = keras.Input((T,), dtype="int32")
  h = L.Embedding(11, 4)(inp)
  return keras.Model(inp, L.Dense(11)(rnn(h)))


def _class_loss(y, logits):
  return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)


def _token_loss(y, logits):
  return tf.reduce_mean(_class_loss(y, logits), axis=-1)


def _data(kind, seed=0):
  rng = np.random.default_rng(seed)
  if kind == "attention":
    return (rng.normal(size=(B, T, 5)).astype("float32"),
            rng.integers(0, 3, B).astype("int32"))
  return (rng.integers(0, 11, (B, T)).astype("int32"),
          rng.integers(0, 11, (B, T)).astype("int32"))


def _models():
  return {"attention": (_attention_model, _class_loss),
          "lstm": (lambda: _lm(L.LSTM(6, return_sequences=True)), _token_loss),
          "gru": (lambda: _lm(L.GRU(5, return_sequences=True, reset_after=False)),
                  _token_loss)}


@functools.lru_cache(maxsize=None)
def _model(kind):
  """The model of `kind`, built once per module (the tests only read its weights)."""
  return _models()[kind][0]()


_MEMOS = {}   # kind -> the reference loop's per-record gradients on _data(kind) (conftest memo)


def _run(model, x, y, loss, clip, mask, jit, static):
  spec = lambda a: tf.TensorSpec((B if static else None,) + a.shape[1:], tf.as_dtype(a.dtype))
  sig = [spec(x), spec(y)] + ([spec(mask)] if mask is not None else [])

  def step(xb, yb, *m):
    return clipping.clipped_grad_sum(model, xb, yb, loss, clip, mask=m[0] if m else None)

  fn = tf.function(step, input_signature=sig, jit_compile=jit)
  grads, norms = fn(x, y, *([mask] if mask is not None else []))
  return [tf.convert_to_tensor(g).numpy() for g in grads], norms.numpy()


def _chunked_calls(monkeypatch):
  """Records, per budget.over_chunks call, whether it split the batch into chunks."""
  calls, orig = [], budget.over_chunks

  def spy(body, tensors, m, out_specs):
    b = tensors[0].shape[0]
    calls.append(m is not None and (b is None or b > m))
    return orig(body, tensors, m, out_specs)

  monkeypatch.setattr(budget, "over_chunks", spy)
  return calls


def _budget(monkeypatch, keep):
  """Chunks of 8 examples; per-record gradients never kept (keep False), or kept by the
  batch's bytes alone (keep True: the operand rule of budget.keep_choice off, so that a batch
  the trace does not know takes the run-time choice)."""
  monkeypatch.setattr(budget, "CHUNK_BYTES", 1)
  monkeypatch.setattr(budget, "KEEP_BYTES", (1 << 30) if keep else 0)
  orig = budget.keep_choice
  monkeypatch.setattr(budget, "keep_choice",
                      lambda bt, rb, allowed, operand_bytes=0: orig(bt, rb, allowed and keep))


def _check(kind, jit, static, keep, monkeypatch, clip_reference, masked=False):
  _budget(monkeypatch, keep)
  calls = _chunked_calls(monkeypatch)
  model, loss = _model(kind), _models()[kind][1]
  x, y = _data(kind)
  mask = None
  if masked:
    mask = np.ones(B, np.float32)
    mask[[2, 9, 17]] = 0.0
  memo = _MEMOS.setdefault(kind, {})   # each record's loop gradient once per module
  _, ref_norms = clip_reference(model, x, y, loss, 1.0, memo=memo)
  clip = float(np.median(ref_norms))   # some records clipped, some not
  ref, ref_norms = clip_reference(model, x, y, loss, clip, mask=mask, memo=memo)
  got, norms = _run(model, x, y, loss, clip, mask, jit, static)
  # every rule's per-record pass split the batch (under XLA only with a static batch)
  assert calls and all(calls) == (static or not jit)
  live = ref_norms > 0
  np.testing.assert_allclose(norms[live], ref_norms[live], rtol=1e-4)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * max(1.0, np.max(np.abs(r))))


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("kind,jit", [
    ("attention", False), ("lstm", True),
    pytest.param("attention", True, marks=_SLOW), pytest.param("lstm", False, marks=_SLOW),
    pytest.param("gru", False, marks=_SLOW), pytest.param("gru", True, marks=_SLOW)])
def test_chunks_without_kept_gradients_exact(kind, jit, monkeypatch, clip_reference):
  _check(kind, jit, True, False, monkeypatch, clip_reference)


@pytest.mark.parametrize("jit,static", [pytest.param(True, True, marks=_SLOW),
                                        pytest.param(False, True, marks=_SLOW),
                                        pytest.param(False, False, marks=_SLOW)])
def test_chunks_with_kept_gradients_exact(jit, static, monkeypatch, clip_reference):
  _check("attention", jit, static, True, monkeypatch, clip_reference)


@pytest.mark.parametrize("kind,keep", [("attention", True),
                                       pytest.param("lstm", False, marks=_SLOW),
                                       pytest.param("attention", False, marks=_SLOW)])
def test_unknown_batch_chunks_exact(kind, keep, monkeypatch, clip_reference):
  """A batch the trace does not know (fit's Poisson samples): the chunked loop and, for the
  kept gradients, the run-time choice."""
  _check(kind, False, False, keep, monkeypatch, clip_reference)


@pytest.mark.parametrize("kind,jit", [("attention", False),
                                      pytest.param("lstm", True, marks=_SLOW)])
def test_masked_records_exact(kind, jit, monkeypatch, clip_reference):
  _check(kind, jit, True, False, monkeypatch, clip_reference, masked=True)


@pytest.mark.parametrize("keep,jit", [(False, False), (True, False),
                                      pytest.param(False, True, marks=_SLOW)])
def test_non_finite_record_adds_nothing(keep, jit, monkeypatch):
  """A record with an infinite input gets c = 0 and adds exactly nothing (its rows are
  zeroed in every chunk's products, no branch): the sums equal those of the other records."""
  _budget(monkeypatch, keep)
  model = _model("attention")
  x, y = _data("attention", seed=2)
  bad = x.copy()
  bad[11, 3, 1] = np.inf
  mask = np.ones(B, np.float32)
  mask[11] = 0.0
  got, norms = _run(model, bad, y, _class_loss, 0.5, None, jit, True)
  assert not np.isfinite(norms[11])
  want, _ = _run(model, x, y, _class_loss, 0.5, mask, jit, True)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_keep_choice_by_operands_or_batch_bytes():
  """Kept when no larger than the operands they replace (whatever the batch), else while the
  batch's gradients fit KEEP_BYTES; never when the rule does not allow it."""
  x = tf.zeros([1024, 3])
  big = budget.KEEP_BYTES
  assert budget.keep_choice(x, big, True, operand_bytes=big) is True
  assert budget.keep_choice(x, big // 1024, True) is True
  assert budget.keep_choice(x, big // 1024 + 4, True) is False
  assert budget.keep_choice(x, 4, False, operand_bytes=big) is False


def test_chunk_size_fits_the_budget():
  """chunk_size: the largest power of two (at least 8) whose temporaries fit CHUNK_BYTES,
  whole records."""
  per_example = 100 << 10   # 100 KiB
  m = budget.chunk_size(per_example, 1)
  assert m * per_example <= budget.CHUNK_BYTES < 2 * m * per_example
  assert budget.chunk_size(per_example, 3) % 3 == 0
  assert budget.chunk_size(budget.CHUNK_BYTES * 4, 1) == 8
  assert budget.chunk_size(1, 1, cap=64) == 64
