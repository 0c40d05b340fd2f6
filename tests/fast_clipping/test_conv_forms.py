"""The convolution rule's forms (rules/conv.py, rules/conv_unfold.py): the folded patch Gram
equals the Gram of the unfolded patches, the depthwise per-example filter gradients equal
per-example Conv2DBackpropFilter, the per-example forms over chunks of the batch and under the
keep budget (the memory budget) give the per-record reference's norms and clipped sums (static
and unknown batch, records, XLA, a non-finite record; where the sum is not formed from the
gradients whose norms are taken the norms are upper bounds: one-sided, at most 1e-3 above), and
the cost model picks the
measured-cheaper form for the tutorial CNN's two convolutions."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import clipping
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import budget
from tf_dpiter.keras.fast_clipping.rules import conv
from tf_dpiter.keras.fast_clipping.rules import conv_unfold

from . import covers

# (input [H, W, cin], kernel, strides, padding, output [ho, wo])
GEOMETRIES = [
    ((28, 28, 1), (8, 8), (2, 2), "same", (14, 14)),    # the tutorial CNN's first conv
    ((13, 13, 4), (4, 4), (2, 2), "valid", (5, 5)),     # its second (fewer channels)
    ((9, 7, 2), (4, 2), (2, 2), "valid", (3, 3)),
    ((8, 7, 2), (4, 3), (2, 1), "same", (4, 7)),
    ((1, 9, 3), (1, 4), (1, 2), "same", (1, 5)),        # a Conv1D's 2-D view
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g[1:4]) for g in GEOMETRIES])
@pytest.mark.parametrize("k", [1, 2])
def test_patch_gram_equals_gram_of_unfolded_patches(geometry, k):
  in_shape, ksize, strides, padding, out_hw = geometry
  x = tf.constant(np.random.default_rng(0).normal(size=(4,) + in_shape), tf.float32)
  assert conv_unfold.foldable(x, ksize, strides, (1, 1), out_hw)
  p, _ = conv_unfold.patches(x, ksize, strides, (1, 1), padding, out_hw)
  t = out_hw[0] * out_hw[1]
  p = tf.reshape(p, [4 // k, k * t, -1])
  want = tf.linalg.matmul(p, p, transpose_b=True).numpy()
  got = conv_unfold.patch_gram(x, ksize, strides, padding, out_hw, k).numpy()
  assert got.shape == (4 // k, k * t, k * t)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_patch_gram_not_for_dilated_or_nondividing_strides():
  x = tf.zeros([2, 9, 9, 1])
  assert not conv_unfold.foldable(x, (3, 3), (2, 2), (1, 1), (4, 4))
  assert not conv_unfold.foldable(x, (4, 4), (2, 2), (2, 2), (3, 3))
  assert not conv_unfold.foldable(x, (4, 4), (2, 2), (1, 1), None)


def test_depthwise_chunk_equals_per_example_filter_gradients():
  """One batch-as-channels depthwise filter gradient (cin > 1: dz repeated over cin): row i
  of [kh kw, m, cin cout] is example i's Conv2DBackpropFilter."""
  rng = np.random.default_rng(1)
  x = tf.constant(rng.normal(size=(5, 10, 10, 2)), tf.float32)
  dz = tf.constant(rng.normal(size=(5, 5, 5, 3)), tf.float32)
  got = conv._depthwise_chunk(x, dz, (4, 4), (2, 2), "same").numpy()
  assert got.shape == (16, 5, 6)
  for i in range(5):
    want = tf.compat.v1.nn.conv2d_backprop_filter(
        x[i:i + 1], [4, 4, 2, 3], dz[i:i + 1], [1, 2, 2, 1], "SAME").numpy()
    np.testing.assert_allclose(got[:, i, :].reshape(4, 4, 2, 3), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2, "tensor"])
@pytest.mark.parametrize("jit", [False, True])
def test_record_sqr_norms_sum_each_records_gradient(k, jit):
  """The squared norms of the records' summed gradients from [A, m, P] per-example gradients
  (the inner axis reduced first, then the first), in a tf.function with the chunk unknown and
  under XLA; a non-finite example's record is not finite, the others are exact."""
  rng = np.random.default_rng(4)
  g = rng.normal(size=(6, 8, 5)).astype(np.float32)
  g[:, 5, 2] = np.inf
  kk = 2 if k == "tensor" else k
  want = np.square(g.reshape(6, 8 // kk, kk, 5).sum(axis=2)).sum(axis=(0, 2))
  fn = tf.function(
      lambda g: conv._record_sqr_norms(g, tf.constant(2) if k == "tensor" else k),
      input_signature=[tf.TensorSpec([6, None, 5])], jit_compile=jit)
  got = fn(tf.constant(g)).numpy()
  assert got.shape == (8 // kk,)
  finite = np.isfinite(want)
  assert not finite.all() and np.array_equal(np.isfinite(got), finite)
  np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5)


def _cnn(first_filters=4):
  """A small CNN with the tutorial's geometry (a large strided first kernel, then a folded
  one): conv 8x8/2 same, conv 4x4/2 valid, dense."""
  keras.utils.set_random_seed(0)
  L = keras.layers
  return keras.Sequential([keras.Input((16, 16, 1)),
                           L.Conv2D(first_filters, 8, strides=2, padding="same",
                                    activation="relu"),
                           L.Conv2D(3, 4, strides=2, activation="relu"),
                           L.Flatten(), L.Dense(3)])


@functools.lru_cache(maxsize=None)
def _shared_cnn():
  """_cnn() built once per module for the tests that only read its weights."""
  return _cnn()


_MEMOS = {}   # k -> the reference loop's per-record gradients on the forms test's data


def _xent(y, logits):
  return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


# (form override or None for the cost model's, budget.CHUNK_BYTES, budget.KEEP_BYTES, unknown
# batch, XLA, examples per record): one chunk or chunks of 8 examples (the last padded), per-example
# gradients kept or the sum by book-keeping (the folded Gram: norms over chunks); under XLA the CPU-kernel forms fall back to the
# unfolded patches; a batch the XLA trace does not know is one call with the gradients kept.
BIG = 1 << 30
CASES = [("depthwise", BIG, BIG, False, False, 1), ("depthwise", 1, BIG, True, False, 2),
         ("depthwise", 1, 0, True, False, 1), ("depthwise", 1, 0, False, False, 2),
         ("filter", 1, BIG, False, False, 1), ("filter", BIG, 0, True, False, 2),
         ("direct", 1, BIG, True, False, 1), ("direct", 1, BIG, False, True, 2),
         ("direct", BIG, 0, False, True, 1), ("depthwise", 1, BIG, False, True, 1),
         ("foldgram", 1, BIG, True, False, 2), ("foldgram", 1, BIG, False, True, 1),
         (None, None, None, True, False, 1), (None, 1, 0, False, True, 2),
         ("depthwise", 1, 0, True, True, 1), ("foldgram", 1, 0, True, True, 2)]


# By default a cover of CASES (covers.cover): each form kept and by book-keeping, each form
# in graph mode and under XLA (where it runs there), each chunking, the unknown batch in graph
# mode and under XLA, records of 1 and 2 in graph mode and under XLA; the rest nightly (-m slow).
COVER = [(0, 2), (0, 4), (1,), (3, 4), (4, 5)]
CASES_DEFAULT = covers.cover(CASES, COVER)


def _case_id(case):
  return "-".join(map(str, case))


SLOW_CASES = {f"test_chunked_and_kept_forms_equal_per_record_reference[{_case_id(c)}]"
              for c in CASES if c not in CASES_DEFAULT}
# records of 1, 2 and 4 stay by default ([1-True], [2-False], [4-False]: graph and XLA, one
# example and several); 3 and the other modes nightly
SLOW_CASES |= {f"test_fold_gram_norm_is_a_float32_upper_bound[{case}]"
               for case in ("1-False", "2-True", "3-False", "3-True", "4-True")}


def test_default_forms_cases_cover_the_grid():
  covers.assert_covers(CASES_DEFAULT, CASES, COVER)
  assert len(CASES_DEFAULT) < len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_chunked_and_kept_forms_equal_per_record_reference(case, monkeypatch, clip_reference):
  """The per-example forms over chunks and under the keep budget give the per-record
  reference's norms and clipped sum, in a tf.function with a static or unknown batch and
  under XLA. The folded Gram's norms and those of the forms whose sum is by book-keeping are
  upper bounds (the exact norm plus gamma_L sum_t ||a_t|| ||b_t||, the float32 rounding of
  the record's terms, 3e-4..6e-4 relative here): never below the reference's, at most 1e-3
  above; the clipped sum within 1e-3 (its clip factors move with the norms)."""
  form, chunk_bytes, keep_bytes, dynamic_batch, jit, k = case
  if chunk_bytes is not None:
    monkeypatch.setattr(budget, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(budget, "KEEP_BYTES", keep_bytes)
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", form)
  model = _shared_cnn()
  rng = np.random.default_rng(2)
  # chunks of at most 8 examples: 17 examples in 3 chunks of 6 (the last padded with one zero
  # example); 9 records of 2 in 3 chunks of 3 records
  b = 18 if k == 2 else 17
  x = tf.constant(rng.normal(size=(b, 16, 16, 1)), tf.float32)
  y = tf.constant(rng.integers(0, 3, b), tf.int32)
  shape = [None if dynamic_batch else b]
  spec = [tf.TensorSpec(shape + [16, 16, 1]), tf.TensorSpec(shape, tf.int32)]
  fn = tf.function(lambda x, y: clipping.clipped_grad_sum(model, x, y, _xent, 0.5,
                                                          examples_per_record=k),
                   input_signature=spec, jit_compile=jit)
  grads, norms = fn(x, y)
  want, want_norms = clip_reference(model, x, y, _xent, 0.5, k=k,
                                    memo=_MEMOS.setdefault(k, {}))   # same data for each k
  norms = norms.numpy()
  assert np.all(norms >= want_norms * (1 - 1e-6)), norms / want_norms
  assert np.all(norms <= want_norms * (1 + 1e-3)), norms / want_norms
  for g, w in zip(grads, want):
    np.testing.assert_allclose(g.numpy(), w, rtol=1e-3, atol=2e-5)


@pytest.mark.parametrize("keep_bytes", [1 << 30, 0], ids=["kept", "bookkeeping"])
def test_non_finite_record_adds_nothing(keep_bytes, monkeypatch, clip_reference):
  """A record whose gradient is not finite (an inf input) gets clip factor 0 and adds
  exactly nothing, from the kept gradients and by book-keeping alike."""
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", "depthwise")
  monkeypatch.setattr(budget, "CHUNK_BYTES", 1)
  monkeypatch.setattr(budget, "KEEP_BYTES", keep_bytes)
  model = _shared_cnn()
  rng = np.random.default_rng(3)
  x = rng.normal(size=(10, 16, 16, 1)).astype(np.float32)
  y = rng.integers(0, 3, 10).astype(np.int32)
  bad = x.copy()
  bad[4, 3, 3, 0] = np.inf
  grads, norms = tf.function(lambda x, y: clipping.clipped_grad_sum(
      model, x, y, _xent, 0.5))(tf.constant(bad), tf.constant(y))
  assert not np.isfinite(norms.numpy()[4])
  keep = [i for i in range(10) if i != 4]
  want, _ = clip_reference(model, tf.constant(x[keep]), tf.constant(y[keep]), _xent, 0.5)
  for g, w in zip(grads, want):
    assert np.all(np.isfinite(g.numpy()))
    np.testing.assert_allclose(g.numpy(), w, rtol=2e-4, atol=2e-5)


def test_chunk_size_from_the_budget(monkeypatch):
  """The tutorial CNN's first convolution: depthwise chunks of _DEPTHWISE_CHUNK_CHANNELS // cin
  examples under the default budget, one call up to _DEPTHWISE_CHANNELS // cin, fewer
  examples when the budget is small, whole records always; a layer of more input channels
  gets fewer examples per call (oneDNN's kernel slows down from 512 input channels)."""
  x, dz = tf.zeros([3, 28, 28, 1]), tf.zeros([3, 14, 14, 16])
  form = conv._per_example_form("depthwise", x, dz, (8, 8), (2, 2), (1, 1), "same")
  size = lambda k: budget.chunk_size(form.temp_bytes, k, form.cap)
  assert size(1) == form.cap == conv._DEPTHWISE_CHUNK_CHANNELS
  assert form.whole == conv._DEPTHWISE_CHANNELS
  wide = conv._per_example_form("depthwise", tf.zeros([3, 28, 28, 4]), dz, (8, 8), (2, 2),
                                (1, 1), "same")
  assert wide.cap * 4 == conv._DEPTHWISE_CHUNK_CHANNELS
  assert wide.whole * 4 == conv._DEPTHWISE_CHANNELS
  monkeypatch.setattr(budget, "CHUNK_BYTES", 64 * form.temp_bytes)
  assert size(1) == 64
  assert size(3) == 63
  monkeypatch.setattr(budget, "CHUNK_BYTES", 1)
  assert size(1) == 8
  assert size(16) == 16


# (input [H, W, cin], kernel, strides, padding, output [ho, wo], examples per record)
_FOLD_GRAM_MEMORY_CASES = [
    ((13, 13, 16), (4, 4), (2, 2), "valid", (5, 5), 1),   # the tutorial CNN's second conv
    ((13, 13, 16), (4, 4), (2, 2), "valid", (5, 5), 2),
    ((14, 14, 8), (4, 4), (2, 2), "same", (7, 7), 1),
]


@pytest.mark.parametrize("case", _FOLD_GRAM_MEMORY_CASES, ids=str)
def test_fold_gram_temp_bytes_bound_the_allocator_peak(case):
  """The folded Gram's temporaries per example (`_fold_gram_temp_bytes`, which sets its chunk)
  bound what TensorFlow's allocator holds at its peak beyond the inputs while the bounded
  norms of 256 examples are formed (with the clipped sum's rounding, as the rule calls it);
  the tutorial CNN's second convolution gets one call of 256 examples under the default budget
  (chunks of 128 for records of 2: the contraction's float32 temporaries count)."""
  in_shape, ksize, strides, padding, out_hw, k = case
  b = 256
  rng = np.random.default_rng(0)
  x = tf.constant(rng.normal(size=(b,) + in_shape), tf.float32)
  dz = tf.constant(rng.normal(size=(b,) + out_hw + (32,)), tf.float32)
  per_example = conv._fold_gram_temp_bytes(x, dz, ksize, strides, k)

  @tf.function
  def norms(x, dz):
    with algebra.examples_per_record(k):
      return conv._fold_gram_sqr_norm(x, dz, ksize, strides, padding,
                                      b * out_hw[0] * out_hw[1])

  norms(x, dz)   # traced, first allocations made
  peaks = []
  for _ in range(3):
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    norms(x, dz).numpy()
    peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - base)
  # within 25 %: TensorFlow's CPU allocator counts each buffer at its allocator's usable size
  # (jemalloc's, which the default tier's processes run on when installed, is a size class up
  # to 25 % above the size asked for: 14 MiB for a 12.6 MiB buffer), and the executor's order
  # may keep one more buffer alive at once in some runs (8.47 against 7.83 MB under glibc,
  # one run of three, session 41)
  rounding = 1.25
  assert 0 < max(peaks) <= b * per_example * rounding, (peaks, b * per_example, rounding)
  if in_shape == (13, 13, 16):
    assert budget.chunk_size(per_example, k) == {1: 256, 2: 128}[k]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_fold_gram_norm_is_a_float32_upper_bound(k, jit):
  """The folded Gram's squared norms (conv._fold_gram_contraction: the float32 contraction
  plus its rounding bound) are never below the exact ones (a float64 loop over the unfolded
  patches) and at most 1e-3 above, for records of 1 to 4 examples of the tutorial CNN's second
  convolution's shapes (non-negative inputs, as after a ReLU and pooling), in graph mode and
  under XLA; no float64 tensor is on the path."""
  rng = np.random.default_rng(k)
  b = 24
  x = tf.constant(np.maximum(rng.normal(size=(b, 13, 13, 16)), 0.0), tf.float32)
  dz = tf.constant(rng.normal(size=(b, 5, 5, 32)), tf.float32)
  p, _ = conv_unfold.patches(x, (4, 4), (2, 2), (1, 1), "valid", (5, 5))
  p = p.numpy().astype(np.float64).reshape(b // k, k * 25, -1)
  d = dz.numpy().astype(np.float64).reshape(b // k, k * 25, 32)
  want = np.sum(np.einsum("btk,btn->bkn", p, d) ** 2, axis=(1, 2))

  def norms(x, dz):
    with algebra.examples_per_record(k):
      return conv._fold_gram_sqr_norm(x, dz, (4, 4), (2, 2), "valid")

  fn = tf.function(norms, jit_compile=jit)
  got = fn(x, dz).numpy()
  assert np.all(got >= want) and np.all(got <= want * (1 + 1e-3)), got / want - 1
  graph = fn.get_concrete_function(x, dz).graph
  assert not [op.name for op in graph.get_operations()
              if any(t.dtype == tf.float64 for t in op.outputs)]


@pytest.mark.parametrize("b", [1, 7, 8, 9, 17, 127, 128, 129, 256, 257, 383, 1000])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_balanced_chunks_pad_less_than_one_record_per_chunk(b, k):
  """A batch of b examples in n = ceil(b / m) chunks of equal size: at most m examples per
  chunk, whole records, and fewer than n k padding examples (chunks of exactly m padded a
  Poisson batch of 257 to 384 when m = 128); the same with a tensor batch."""
  b = b // k * k or k
  m = 128 // k * k
  n, chunk = budget.balanced_chunk(b, m, k)
  assert n == -(-b // m) and chunk <= m and chunk % k == 0
  assert b <= n * chunk < b + n * k
  n_t, chunk_t = budget.balanced_chunk(tf.constant(b), m, k)
  assert (int(n_t), int(chunk_t)) == (n, chunk)


def _form(in_shape, ksize, strides, out_shape, k=1):
  x = tf.zeros((3,) + in_shape)
  dz = tf.zeros((3,) + out_shape)
  with algebra.examples_per_record(k):
    return conv._choose_form(dz, x, ksize, strides, (1, 1), keep=True)


def test_cost_model_forms_of_the_tutorial_cnn(monkeypatch):
  """Second conv (T = 25 positions, patch 256, 32 filters): the folded Gram (about 0.1M
  multiply-adds per example for the norm) against 0.2M for the per-example gradient.
  First conv (T = 196, patch 64, 16 filters): the per-example gradient (the Gram's T^2
  terms are 1.3M)."""
  monkeypatch.setattr(registry, "_FORM_OVERRIDE", None)
  assert _form((13, 13, 16), (4, 4), (2, 2), (5, 5, 32)) == "foldgram"
  assert _form((13, 13, 16), (4, 4), (2, 2), (5, 5, 32), k=2) == "foldgram"
  assert _form((13, 13, 16), (4, 4), (2, 2), (5, 5, 32), k=tf.constant(2)) is None
  assert _form((28, 28, 1), (8, 8), (2, 2), (14, 14, 16)) in ("depthwise", None)
  assert _form((13, 13, 16), (3, 3), (2, 2), (6, 6, 32)) is None   # stride does not divide
