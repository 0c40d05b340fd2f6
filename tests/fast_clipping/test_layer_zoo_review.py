"""Review: the layers the earlier reviews did not reach. For each model below two checks,
graph and XLA:

  exactness against an independent oracle: a float64 copy of the model (every layer built
    with dtype float64, the float32 weights copied) differentiated one record at a time with
    its own tape (no output gradient of the fast path reused): the fast path's per-record
    norm must be an upper bound of that float64 norm (>= exact (1 - 1e-6), float32 rounding
    of the inputs' own sums) and not looser than needed on ordinary records (<= exact
    (1 + 1e-3)); records of 1 and of 2 examples (the latter at a batch the trace does not
    know), magnitudes 0.1 .. 100 mixed across records.
  cancellation: inputs of one vector repeated over the positions (one entry moved by delta),
    a frozen head w at position 0 and -w (1 + 2^-23) at position 1, labels 1e3 .. 1e7 (the
    constructions of test_layer_cancellation_review): each record alone moves the noise-off
    clipped sum by at most C (1 + 1e-3).

Layers: DepthwiseConv2D (depth multiplier 2, dilation 2), SeparableConv2D, Conv2D dilated,
Conv1D causal (dilation 2), Conv2DTranspose, Conv3D, GRU (reset_after both ways),
Bidirectional(LSTM), TimeDistributed(Dense), one Dense called twice (shared weights: the norm
of the sum of both calls' gradients), Embedding with mask_zero and repeated ids.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import clipping

from .covers import assert_covers
from .covers import cover
from .covers import slow_outside
from .test_gram_cancellation_review import C
from .test_gram_cancellation_review import _LOSS
from .test_gram_cancellation_review import _contributions
from .test_layer_cancellation_review import _assert_within_c

L = keras.layers


def _frozen_head(z, dtype, positions_w=None):
  """Flatten -> Dense(1) frozen: w at position 0, -w (1 + 2^-23) at position 1, 0 else
  (positions_w None: random weights, still frozen)."""
  head = L.Dense(1, use_bias=False, dtype=dtype, trainable=False)
  flat = L.Flatten(dtype=dtype)(z) if len(z.shape) > 2 else z
  return head, head(flat)


def _set_head(head, z_shape, cancel):
  positions = int(np.prod(z_shape[1:-1])) if len(z_shape) > 2 else 1
  units = z_shape[-1]
  rng = np.random.RandomState(1)
  if not cancel:
    head.kernel.assign(rng.normal(size=(positions * units, 1)) / np.sqrt(positions * units))
    return
  w = rng.normal(size=units).astype("float32")
  kernel = np.zeros((positions, units), np.float32)
  kernel[0] = w
  kernel[1] = -np.nextafter(w, 2 * w)
  head.kernel.assign(kernel.reshape(-1, 1))


def _depthwise(dtype):
  inp = keras.Input((8, 8, 4), dtype=dtype)
  return inp, L.DepthwiseConv2D(3, depth_multiplier=2, dilation_rate=2, padding="same",
                                dtype=dtype)(inp)


def _separable(dtype):
  inp = keras.Input((8, 8, 4), dtype=dtype)
  return inp, L.SeparableConv2D(6, 3, depth_multiplier=2, padding="same", dtype=dtype)(inp)


def _conv2d_dilated(dtype):
  inp = keras.Input((9, 9, 3), dtype=dtype)
  return inp, L.Conv2D(5, 3, dilation_rate=2, padding="same", dtype=dtype)(inp)


def _conv1d_causal(dtype):
  inp = keras.Input((10, 4), dtype=dtype)
  return inp, L.Conv1D(6, 3, padding="causal", dilation_rate=2, dtype=dtype)(inp)


def _conv2d_transpose(dtype):
  inp = keras.Input((5, 5, 3), dtype=dtype)
  return inp, L.Conv2DTranspose(4, 3, strides=2, dtype=dtype)(inp)


def _conv3d(dtype):
  inp = keras.Input((4, 4, 4, 3), dtype=dtype)
  return inp, L.Conv3D(4, 2, dtype=dtype)(inp)


def _gru(reset_after):
  def build(dtype):
    inp = keras.Input((5, 4), dtype=dtype)
    return inp, L.GRU(6, return_sequences=True, reset_after=reset_after, dtype=dtype)(inp)
  return build


def _bidirectional(dtype):
  inp = keras.Input((5, 4), dtype=dtype)
  return inp, L.Bidirectional(L.LSTM(5, return_sequences=True, dtype=dtype),
                              dtype=dtype)(inp)


def _time_distributed(dtype):
  inp = keras.Input((5, 4), dtype=dtype)
  return inp, L.TimeDistributed(L.Dense(6, dtype=dtype), dtype=dtype)(inp)


def _shared_dense(dtype):
  """One Dense called on the input and on its tanh: the record's gradient is the sum of
  both calls' gradients (their cross term in its norm)."""
  inp = keras.Input((3, 6), dtype=dtype)
  dense = L.Dense(6, dtype=dtype)
  first = dense(inp)
  second = dense(L.Activation("tanh", dtype=dtype)(first))
  return inp, L.Concatenate(axis=1, dtype=dtype)([first, second])


def _layer_norm(dtype):
  inp = keras.Input((5, 4), dtype=dtype)
  return inp, L.LayerNormalization(dtype=dtype)(inp)


def _layer_norm_axes(axis):
  def build(dtype):
    inp = keras.Input((5, 4), dtype=dtype)
    return inp, L.LayerNormalization(axis=axis, dtype=dtype)(inp)
  return build


def _conv2d_groups(dtype):
  inp = keras.Input((6, 6, 4), dtype=dtype)
  return inp, L.Conv2D(4, 3, groups=2, dtype=dtype)(inp)


def _conv2d_strided(dtype):
  inp = keras.Input((8, 8, 3), dtype=dtype)
  return inp, L.Conv2D(4, 4, strides=2, dtype=dtype)(inp)


def _dense_one_position(dtype):
  inp = keras.Input((1, 6), dtype=dtype)
  return inp, L.Dense(5, dtype=dtype)(inp)


def _lstm(dtype):
  inp = keras.Input((5, 4), dtype=dtype)
  return inp, L.LSTM(5, return_sequences=True, dtype=dtype)(inp)


BUILDERS = {
    "depthwise": _depthwise, "separable": _separable, "conv2d_dilated": _conv2d_dilated,
    "conv1d_causal": _conv1d_causal, "conv2d_transpose": _conv2d_transpose,
    "conv3d": _conv3d, "gru_reset_after": _gru(True), "gru_reset_before": _gru(False),
    "bidirectional": _bidirectional, "time_distributed": _time_distributed,
    "shared_dense": _shared_dense,
}
# registered rules only reached by the unknown-batch test
MORE = {"layer_norm": _layer_norm, "conv2d_strided": _conv2d_strided,
        "dense_one_position": _dense_one_position, "lstm": _lstm,
        "layer_norm_axis_1": _layer_norm_axes(1), "layer_norm_axes_1_2": _layer_norm_axes([1, 2]),
        "conv2d_groups": _conv2d_groups}


def _models(name, cancel):
  """(float32 model, float64 copy with the same weights)."""
  out = []
  for dtype in ("float32", "float64"):
    keras.utils.set_random_seed(0)
    inp, z = {**BUILDERS, **MORE}[name](dtype)
    head, pred = _frozen_head(z, dtype)
    _set_head(head, z.shape, cancel)
    out.append(keras.Model(inp, pred))
  out[1].set_weights(out[0].get_weights())
  return out


def exact_norms(model64, x, y, k=1):
  """Per-record gradient norms of the float64 model, each record on its own tape: the mean
  over its k examples of the squared error."""
  norms = []
  for i in range(0, x.shape[0], k):
    xr = tf.nest.map_structure(lambda a: tf.constant(a[i:i + k]) if a.dtype.kind in "iu" else
                               tf.constant(a[i:i + k], tf.float64), x)
    with tf.GradientTape() as tape:
      pred = model64(xr, training=True)
      loss = tf.reduce_mean(tf.square(pred - tf.constant(y[i:i + k], tf.float64)))
    grads = tape.gradient(loss, model64.trainable_variables)
    norms.append(np.sqrt(sum(np.sum(np.square(tf.convert_to_tensor(g).numpy()))
                             for g in grads if g is not None)))
  return np.array(norms)


def fast_norms(model, x, y, jit, k=1, known_batch=True):
  """The fast path's per-record norms; `known_batch` False: traced with the batch None (an
  input_signature, as fit's sampled datasets give)."""
  spec = None if known_batch else [
      tf.TensorSpec((None,) + x.shape[1:], tf.as_dtype(x.dtype)),
      tf.TensorSpec((None,) + y.shape[1:], tf.float32)]
  fn = tf.function(lambda x, y: clipping.clipped_grad_sum(
      model, x, y, _LOSS, C, examples_per_record=k, physical_chunks=False)[1],
      jit_compile=jit, input_signature=spec)
  return fn(tf.nest.map_structure(tf.constant, x), tf.constant(y)).numpy().astype(np.float64)


def assert_upper_bound(norms, exact, loose=1e-3):
  """norms >= exact (1 - 1e-6) (an upper bound up to the float32 rounding of the inputs'
  own sums) and <= exact (1 + loose)."""
  rel = norms / exact - 1.0
  assert np.all(rel >= -1e-6), (rel.min(), np.argmin(rel))
  assert np.all(rel <= loose), (rel.max(), np.argmax(rel))


def _ordinary(model64, shape, count=8, seed=5):
  """Records of magnitudes 0.1 .. 100 (at 1e3 a saturated GRU record of norm 4e-4 got +5 % from
  the rounding bound: harmless, the norm far below C); labels 100 |output| + 1 away from the output, so
  that the float32 forward's rounding of the residual (not a norm's) stays ~1e-9 relative."""
  rng = np.random.RandomState(seed)
  x = np.stack([rng.normal(size=shape) * 10.0 ** rng.uniform(-1, 2) for _ in range(count)])
  out = model64(x.astype("float32").astype("float64")).numpy()
  y = out - np.sign(rng.normal(size=out.shape)) * (100 * np.abs(out) + 1)
  return x.astype("float32"), y.astype("float32")


def _cancelling(shape, count=12, seed=2):
  """One vector a (|a| 10 .. 1e4) at every position, the first entry moved by delta."""
  rng = np.random.RandomState(seed)
  xs = []
  for _ in range(count):
    x = np.broadcast_to(rng.normal(size=shape[-1]) * 10.0 ** rng.uniform(1, 4), shape).copy()
    x.reshape(-1)[0] += 10.0 ** rng.uniform(-3, 0)
    xs.append(x)
  return (np.stack(xs).astype("float32"),
          (10.0 ** rng.uniform(3, 7, (count, 1))).astype(np.float32))


# (check, layer, jit): the three checks on each layer of BUILDERS, the unknown-batch check on
# those of MORE, each in graph and under XLA; by default one case per layer (the rule) and
# each check in both modes (the path), the rest marked slow (`-m slow`: the whole grid).
GRID = [(check, name, jit) for check in ("known", "unknown", "cancel")
        for name in list(BUILDERS) + (list(MORE) if check == "unknown" else [])
        for jit in (False, True)]
GROUPS = [(1,), (0, 2)]
DEFAULT = cover(GRID, GROUPS)


def test_default_cases_cover_every_layer_and_check_mode():
  assert_covers(DEFAULT, GRID, GROUPS)
  assert len(DEFAULT) < 0.3 * len(GRID)


def _params(check):
  return slow_outside([c[1:] for c in GRID if c[0] == check],
                      [c[1:] for c in DEFAULT if c[0] == check])


@pytest.mark.parametrize("name,jit", _params("known"))
def test_norms_bound_an_independent_float64_gradient(name, jit):
  """Records of one example, a known batch (records of 2: test_unknown_batch_records_of_two)."""
  model, model64 = _models(name, cancel=False)
  x, y = _ordinary(model64, model.input.shape[1:])
  assert_upper_bound(fast_norms(model, x, y, jit), exact_norms(model64, x, y))


@pytest.mark.parametrize("name,jit", _params("unknown"))
def test_unknown_batch_records_of_two(name, jit):
  """The batch unknown to the trace, records of 2 (fit's sampled datasets with microbatches):
  the trace must not fail (a reshape by a shape tensor did, algebra.factor_product, for a
  Dense on [B, 1, K]) and the norms bound the float64 ones."""
  model, model64 = _models(name, cancel=False)
  x, y = _ordinary(model64, model.input.shape[1:])
  assert_upper_bound(fast_norms(model, x, y, jit, 2, known_batch=False),
                     exact_norms(model64, x, y, 2))


@pytest.mark.parametrize("name,jit", _params("cancel"))
def test_cancelling_positions_stay_within_c(name, jit):
  model, _ = _models(name, cancel=True)
  x, y = _cancelling(model.input.shape[1:])
  _assert_within_c(_contributions(model, x, y, jit))


@pytest.mark.parametrize("k,jit", slow_outside([(1, False), (1, True), (2, False), (2, True)],
                                               [(1, True), (2, False)]))
def test_embedding_mask_zero_repeated_ids(k, jit):
  """Embedding(mask_zero) -> GlobalAveragePooling1D (the mask reaches the pooling) on ids
  with repeats and padding 0: norms against the float64 copy."""
  models = []
  for dtype in ("float32", "float64"):
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,), dtype="int32")
    z = L.Embedding(7, 5, mask_zero=True, dtype=dtype)(inp)
    pooled = L.GlobalAveragePooling1D(dtype=dtype)(z)
    models.append(keras.Model(inp, L.Dense(1, dtype=dtype)(pooled)))
  models[1].set_weights(models[0].get_weights())
  rng = np.random.RandomState(0)
  x = rng.randint(0, 3, (8, 6)).astype("int32")   # ids 0 (padding), 1, 2: repeated
  x[:, 0] = 1
  y = (rng.normal(size=(8, 1)) * 10).astype("float32")
  assert_upper_bound(fast_norms(models[0], x, y, jit, k), exact_norms(models[1], x, y, k))
