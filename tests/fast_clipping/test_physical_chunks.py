"""The clipped sum over physical chunks of the batch (clipping.py, issue 42): where the bytes
book-keeping keeps until the clip factors are known exceed budget.KEPT_BYTES, the forward,
the norms and the sum run one chunk of whole records at a time. Here KEPT_BYTES is set so
that a batch of 19 runs as 3 balanced chunks of 7 (the last padded with 2 examples of mask
0). Compared with the per-record reference loop (conftest.per_record_clipped_sum, float64)
and with the sum in one call: with and without jit_compile, with a batch the trace knows or
not, masked records (c = 0), a record whose values are not finite (c = 0, adds nothing) and
records of two examples. Tolerances: float32 round-off (relative 1e-4 on norms, 1e-4 of the
largest entry on the sums)."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping.rules import budget

# Nightly tier (-m slow, besides the marks below): the LM's static chunked sum in
# graph (its XLA case and the attention one stay).
SLOW_CASES = {
    "test_chunked_sum_exact[lm-False-True]"}

L = keras.layers
B, T = 19, 6
_SLOW = pytest.mark.slow


def _lm():
  """Embedding -> LSTM -> Dense logits per token (the LSTM language model's shape)."""
  keras.utils.set_random_seed(5)
  inp = keras.Input((T,), dtype="int32")
  h = L.LSTM(6, return_sequences=True)(L.Embedding(11, 4)(inp))
  return keras.Model(inp, L.Dense(11)(h))


def _attention():
  """Float [T, 5] inputs -> Dense -> self-attention + LayerNorm -> pooled logits."""
  keras.utils.set_random_seed(4)
  inp = keras.Input((T, 5))
  h = L.Dense(8)(inp)
  h = L.LayerNormalization()(h + L.MultiHeadAttention(num_heads=2, key_dim=4)(h, h))
  return keras.Model(inp, L.Dense(3)(L.GlobalAveragePooling1D()(h)))


def _class_loss(y, logits):
  return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)


def _token_loss(y, logits):
  return tf.reduce_mean(_class_loss(y, logits), axis=-1)


def _case(kind, seed=0):
  """(model, x, y, loss) of a batch of B, built once per module and batch size (the tests
  only read the weights)."""
  return _built_case(kind, seed, B)


@functools.lru_cache(maxsize=None)
def _built_case(kind, seed, b):
  rng = np.random.default_rng(seed)
  if kind == "lm":
    return (_lm(), rng.integers(0, 11, (b, T)).astype("int32"),
            rng.integers(0, 11, (b, T)).astype("int32"), _token_loss)
  return (_attention(), rng.normal(size=(b, T, 5)).astype("float32"),
          rng.integers(0, 3, b).astype("int32"), _class_loss)


_MEMOS = {}     # (kind, B) -> the reference loop's per-record gradients (conftest memo)
_WHOLE = {}     # (kind, B, k, mask, clip) -> the unchunked sum's outputs and losses


def _whole(kind, model, x, y, loss, clip, mask, k):
  """The outputs and losses of the sum in one call (graph mode, the batch the trace knows),
  once per module for a case's model, data, mask and clip."""
  key = (kind, B, k, None if mask is None else mask.tobytes(), clip)
  if key not in _WHOLE:
    _WHOLE[key] = _run(model, x, y, loss, clip, mask, False, True, k)[2:]
  return _WHOLE[key]


def _force_chunks(monkeypatch):
  """KEPT_BYTES such that chunks hold 8 examples; returns the list of chunked calls."""
  monkeypatch.setattr(budget, "KEPT_BYTES", 1)
  calls, orig = [], clipping._chunked_grad_sum   # pylint: disable=protected-access

  def spy(*args, **kwargs):
    calls.append(args[-2])   # m
    return orig(*args, **kwargs)

  monkeypatch.setattr(clipping, "_chunked_grad_sum", spy)
  return calls


def _run(model, x, y, loss, clip, mask, jit, static, k=1):
  spec = lambda a: tf.TensorSpec((B if static else None,) + a.shape[1:], tf.as_dtype(a.dtype))
  sig = [spec(x), spec(y)] + ([spec(mask)] if mask is not None else [])

  def step(xb, yb, *m):
    return clipping.clipped_grad_sum(model, xb, yb, loss, clip, mask=m[0] if m else None,
                                     examples_per_record=k, return_outputs=True)

  fn = tf.function(step, input_signature=sig, jit_compile=jit)
  grads, norms, outputs, losses = fn(x, y, *([mask] if mask is not None else []))
  return ([tf.convert_to_tensor(g).numpy() for g in grads], norms.numpy(), outputs.numpy(),
          losses.numpy())


def _check(kind, jit, static, monkeypatch, clip_reference, masked=False, k=1):
  model, x, y, loss = _case(kind)
  mask = None
  if masked:
    mask = np.ones(B, np.float32)
    mask[[2, 9, 17]] = 0.0
  memo = _MEMOS.setdefault((kind, B), {})   # each record's loop gradient once per module
  _, ref_norms = clip_reference(model, x, y, loss, 1.0, k=k, memo=memo)
  clip = float(np.median(ref_norms))   # some records clipped, some not
  ref, ref_norms = clip_reference(model, x, y, loss, clip, k=k, mask=mask, memo=memo)
  outputs_whole, losses_whole = _whole(kind, model, x, y, loss, clip, mask, k)
  calls = _force_chunks(monkeypatch)
  got, norms, outputs, losses = _run(model, x, y, loss, clip, mask, jit, static, k)
  # chunks of 8 examples (under XLA only with a batch the trace knows)
  assert calls == ([8 // k * k] if static or not jit else [])
  live = ref_norms > 0
  np.testing.assert_allclose(norms[live], ref_norms[live], rtol=1e-4)
  assert norms.shape == ref_norms.shape and outputs.shape[0] == B and losses.shape == (B,)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * max(1.0, np.max(np.abs(r))))
  # the outputs and losses are the batch's, in order (those of the sum in one graph-mode call)
  np.testing.assert_allclose(outputs, outputs_whole, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(losses, losses_whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,jit,static", [
    ("lm", False, True), ("attention", False, False), ("lm", True, True),
    pytest.param("lm", False, False, marks=_SLOW), pytest.param("attention", True, True,
                                                                marks=_SLOW),
    pytest.param("lm", True, False, marks=_SLOW)])
def test_chunked_sum_exact(kind, jit, static, monkeypatch, clip_reference):
  _check(kind, jit, static, monkeypatch, clip_reference)


@pytest.mark.parametrize("kind,jit,static", [("attention", False, False),
                                             pytest.param("lm", False, False, marks=_SLOW),
                                             pytest.param("lm", True, True, marks=_SLOW)])
def test_masked_records_exact(kind, jit, static, monkeypatch, clip_reference):
  _check(kind, jit, static, monkeypatch, clip_reference, masked=True)


def test_records_of_two_examples_exact(monkeypatch, clip_reference):
  """Chunks of whole records (k = 2): a batch of 18 examples, 9 records."""
  global B
  old, B = B, 18
  try:
    _check("lm", False, True, monkeypatch, clip_reference, masked=True, k=2)
  finally:
    B = old


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=_SLOW)])
def test_non_finite_record_adds_nothing(jit, monkeypatch):
  """A record with an infinite input gets c = 0 and adds exactly nothing in its chunk: the
  sums equal those of the batch with that record masked out."""
  calls = _force_chunks(monkeypatch)
  model, x, y, loss = _case("attention", seed=2)
  bad = x.copy()
  bad[11, 3, 1] = np.inf
  mask = np.ones(B, np.float32)
  mask[11] = 0.0
  got, norms, _, _ = _run(model, bad, y, loss, 0.5, None, jit, True)
  assert not np.isfinite(norms[11]) and np.all(np.isfinite(np.delete(norms, 11)))
  want, _, _, _ = _run(model, x, y, loss, 0.5, mask, jit, True)
  assert len(calls) == 2
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_within_budget_is_one_call(monkeypatch):
  """A batch whose kept bytes fit KEPT_BYTES runs as one call (no probe beyond the first,
  no loop); the probe counts at least the logits' output gradient per example."""
  calls, orig = [], clipping._chunked_grad_sum   # pylint: disable=protected-access
  monkeypatch.setattr(clipping, "_chunked_grad_sum",
                      lambda *a, **kw: calls.append(1) or orig(*a, **kw))
  model, x, y, loss = _case("lm")
  got, _, _, _ = _run(model, x, y, loss, 1.0, None, False, True)
  assert not calls and all(np.all(np.isfinite(g)) for g in got)
  kept, signature = clipping._probe(model, tf.constant(x), False, 1)   # pylint: disable=protected-access
  assert kept >= T * 11 * 4 and signature.shape == (T, 11)


def test_kept_chunk_fits_the_budget():
  """kept_chunk: the largest power of two (at least 8) of examples whose kept bytes fit
  KEPT_BYTES, in whole records."""
  per_example = 412_160   # the LSTM LM's logits, input projection and embedding gradients
  m = budget.kept_chunk(per_example, 1)
  assert m * per_example <= budget.KEPT_BYTES < 2 * m * per_example
  assert budget.kept_chunk(budget.KEPT_BYTES * 4, 1) == 8
  assert budget.kept_chunk(per_example, 3) % 3 == 0


def _cnn():
  """28x28x1 -> Conv2D -> MaxPool -> Conv2D -> Dense logits (the tutorial CNN's layer kinds)."""
  keras.utils.set_random_seed(6)
  inp = keras.Input((12, 12, 1))
  h = L.MaxPooling2D(2)(L.Conv2D(4, 3, activation="relu")(inp))
  h = L.Conv2D(3, 2, strides=2)(h)
  return keras.Model(inp, L.Dense(3)(L.Flatten()(h)))


@pytest.mark.parametrize("kind,k", [("lm", 1), ("attention", 2), ("cnn", 1)])
def test_the_pass_measures_the_probes_kept_bytes(kind, k, monkeypatch):
  """A traced pass under CHUNK_CHECK_ATTR (the Keras train step's, with no probe of its own)
  measures the kept bytes per example of its own recorded forward pass: the probe's, on a
  batch the trace does not know; past the budget it stops before its backward pass with
  the probe's chunk size (ChunkedPassNeeded)."""
  monkeypatch.setattr(budget, "KEPT_BYTES", 1)   # chunks of the smallest size
  if kind == "cnn":
    model = _cnn()
    x = np.random.default_rng(0).normal(size=(2 * k, 12, 12, 1)).astype("float32")
    loss = _class_loss
  else:
    model, x, _, loss = _case(kind)
  spec = tf.TensorSpec((None,) + x.shape[1:], tf.as_dtype(x.dtype))
  measured, orig = [], clipping._units_kept_bytes   # pylint: disable=protected-access
  monkeypatch.setattr(clipping, "_units_kept_bytes",
                      lambda units: measured.append(orig(units)) or measured[-1])

  found = []

  def step(xb):
    y = tf.zeros(tf.shape(xb)[:1], tf.int32)
    try:
      clipping.clipped_grad_sum(model, xb, y, loss, 1.0, examples_per_record=k,
                                physical_chunks=False)
    except clipping.ChunkedPassNeeded as signal:   # (its caller catches it in the trace)
      found.append(signal.examples)
    return tf.constant(0)

  setattr(model, clipping.CHUNK_CHECK_ATTR, 1e9)
  try:
    graph = tf.function(step).get_concrete_function(spec).graph
  finally:
    setattr(model, clipping.CHUNK_CHECK_ATTR, None)
  by_the_pass = list(measured)
  kept, _ = clipping._probe(model, spec, k > 1, k)   # pylint: disable=protected-access
  assert kept and by_the_pass == [kept], (by_the_pass, kept)
  assert found == [budget.kept_chunk(kept, k)] == [8 // k * k]
  # stopped after the forward pass and the loss: no gradient of the pass was formed
  assert not [op for op in graph.get_operations() if "backward_to_layers" in op.name]
