"""Layer registry for ghost norms: per-example squared gradient norms of a
layer's trainable variables computed from the layer's inputs and the gradient
at a tensor produced inside the layer, without per-example gradients.

A norm function has the contract

    norm_fn(layer, *call_args, **call_kwargs) -> (outputs, watched, sqr_norm_fn)
        or None to decline (the layer then takes the vectorized path).

  outputs:      what ``layer.call(*call_args, **call_kwargs)`` returns.
  watched:      a tensor or a list of tensors with a leading batch axis,
                computed inside the layer from its trainable variables, such
                that the variables influence ``outputs`` only through
                ``watched`` (Goodfellow 2015, Sec. 2; Lee & Kifer 2021, Sec. 3).
  sqr_norm_fn:  ``sqr_norm_fn(watched_grads) -> [B]`` float32, the squared L2
                norm of the per-example gradient of the loss with respect to
                all of ``layer.trainable_variables`` (concatenated), given the
                gradients of the summed loss at ``watched`` (same structure).
                It may instead return ``PerExampleGrads(sqr_norms, grads)``
                when it has the per-example gradients at hand anyway.

The summed clipped gradient of such a layer is then obtained as a vector-Jacobian
product of ``watched`` with the clip-weighted ``watched_grads`` (book-keeping,
Bu et al. 2023, Sec. 3), so a norm function only provides the norm. When the
norm function returned ``PerExampleGrads``, the clipped sum is
``sum_i c_i g_i`` of those gradients and the vector-Jacobian product is skipped
(per layer, the choice of mixed ghost clipping, Bu et al. 2022, Sec. 3.2): for
a layer with T positions this costs B*T*K*N either way, but saves the second
weight-gradient computation, which is the whole DP overhead of a convolution.
"""

import functools
import threading
from typing import NamedTuple, Sequence

import numpy as np
import tensorflow as tf
import keras
from keras import ops

_LOCK = threading.Lock()
_REGISTRY = {}  # layer class -> norm_fn

# Test hook: force "gram" or "direct" in _factored_sqr_norm, or "filter" /
# "depthwise" for convolutions (per-example filter gradients); None: chosen by
# cost.
_FORM_OVERRIDE = None

# Per-example gradients of a layer are kept (PerExampleGrads) when one example's
# gradient has at most this many entries: 64 KiB in float32, 64 MiB per layer at
# batch 1024. Larger ones are reduced to their norm and summed by book-keeping.
MAX_PER_EXAMPLE_ENTRIES = 1 << 14


class PerExampleGrads(NamedTuple):
  """A sqr_norm_fn result that also carries the per-example gradients.

  sqr_norms: [B] float32, ||g_i||^2 over the layer's trainable variables.
  grads:     one [B, *v.shape] tensor per v in layer.trainable_variables, in
             that order: g_i for each variable.
  """
  sqr_norms: tf.Tensor
  grads: Sequence[tf.Tensor]


def _result(layer, sq, grads_by_var):
  """PerExampleGrads if every trainable variable's g_i is in grads_by_var
  (id(variable) -> [B, ...]), else the squared norms alone."""
  variables = layer.trainable_variables
  if variables and all(id(v) in grads_by_var for v in variables):
    grads = []
    for v in variables:
      g = grads_by_var[id(v)]
      grads.append(tf.reshape(g, [tf.shape(g)[0]] + list(v.shape)))
    return PerExampleGrads(sq, grads)
  return sq


def _keep(num_entries):
  return num_entries is not None and num_entries <= MAX_PER_EXAMPLE_ENTRIES


# Records of k consecutive examples (microbatches): set by clipping while the
# norm functions run; B is then a multiple of k and record j holds examples
# j*k, ..., j*k + k - 1. A record's gradient is the sum of its examples'
# contributions, so every per-example quantity is summed over the record
# before squaring, and factored forms merge k into the position axis.
_RECORDS = threading.local()


class examples_per_record:  # pylint: disable=invalid-name
  """Context: the built-in norm functions return per-record norms for records
  of k consecutive examples (k = 1: per-example)."""

  def __init__(self, k):
    self._k = k

  def __enter__(self):
    self._prev = getattr(_RECORDS, "k", 1)
    _RECORDS.k = self._k
    return self

  def __exit__(self, *exc):
    _RECORDS.k = self._prev


def _k():
  return getattr(_RECORDS, "k", 1)


def record_sum(t):
  """[B, ...] per-example -> [B/k, ...] per-record sums."""
  k = _k()
  if isinstance(k, int) and k == 1:
    return t
  shape = tf.shape(t)
  t = tf.reshape(t, tf.concat([[shape[0] // k, k], shape[1:]], 0))
  return tf.reduce_sum(t, axis=1)


def _regroup_btk(x):
  """[B, T, K] -> [B/k, k*T, K]: a record's positions are its examples'."""
  k = _k()
  if isinstance(k, int) and k == 1:
    return x
  t, last = _static_dim(x, 1), _static_dim(x, 2)
  kt = t * k if (t is not None and isinstance(k, int)) else -1
  last = last if last is not None else tf.shape(x)[2]
  return tf.reshape(x, [tf.shape(x)[0] // k, kt, last])


def _zeros(dz):
  return tf.zeros([tf.shape(dz)[0] // _k()], tf.float32)


def _supports_records(fn):
  """Marks a built-in norm function as honouring examples_per_record."""
  fn.supports_records = True
  return fn


def register_layer(layer_class, norm_fn):
  """Registers ``norm_fn`` (see module docstring) for ``layer_class``.

  The function is used for instances of exactly ``layer_class`` and for
  subclasses that do not override ``call``. Re-registering replaces the
  previous function (built-in ones included).
  """
  if not (isinstance(layer_class, type) and
          issubclass(layer_class, keras.layers.Layer)):
    raise ValueError(
        f"layer_class must be a keras.layers.Layer subclass, got {layer_class!r}")
  if not callable(norm_fn):
    raise ValueError(f"norm_fn must be callable, got {norm_fn!r}")
  with _LOCK:
    _REGISTRY[layer_class] = norm_fn


def lookup(layer):
  """Returns the norm function for ``layer`` or None."""
  cls = type(layer)
  with _LOCK:
    if cls in _REGISTRY:
      return _REGISTRY[cls]
    for base in cls.__mro__[1:]:
      fn = _REGISTRY.get(base)
      if fn is not None:
        # A subclass inherits the norm function only if its forward is the
        # registered class's forward; otherwise the norm could be wrong.
        if getattr(cls, "call", None) is getattr(base, "call", None):
          return fn
        return None
  return None


# ---------------------------------------------------------------------------
# Shared algebra.


def _static_dim(x, axis):
  d = x.shape[axis]
  return None if d is None else int(d)


def _factored_sqr_norm(a, b):
  """Per-example ||sum_t a_t b_t^T||_F^2 for a: [B, T, K], b: [B, T, N].

  Returns (sqr_norms [B], g) with g the [B, K, N] per-example gradient when it
  was materialized (else None). Forms (Li et al. 2021, Sec. 4):
    direct: g_i = a_i^T b_i, cost B T K N; kept when K N is small, since it
            then also replaces the book-keeping product of the same cost;
    Gram:   sum_{t,s} <a_t, a_s><b_t, b_s>, cost B T^2 (K+N), no g;
    T = 1:  ||a||^2 ||b||^2, no g.
  Without an override, direct if g is kept, else the cheaper of the two.
  """
  a = _regroup_btk(tf.cast(a, tf.float32))
  b = _regroup_btk(tf.cast(b, tf.float32))
  t, k, n = _static_dim(a, 1), _static_dim(a, 2), _static_dim(b, 2)
  if t == 1:
    return (tf.reduce_sum(tf.square(a), axis=[1, 2]) *
            tf.reduce_sum(tf.square(b), axis=[1, 2])), None
  keep = k is not None and n is not None and _keep(k * n)
  form = _FORM_OVERRIDE if _FORM_OVERRIDE in ("gram", "direct") else None
  if form is None:
    if keep or t is None or k is None or n is None:
      form = "direct"
    else:
      form = "gram" if t * t * (k + n) < t * k * n + k * n else "direct"
  if form == "gram":
    ga = tf.einsum("btk,bsk->bts", a, a)
    gb = tf.einsum("btn,bsn->bts", b, b)
    return tf.reduce_sum(ga * gb, axis=[1, 2]), None
  g = tf.einsum("btk,btn->bkn", a, b)
  return tf.reduce_sum(tf.square(g), axis=[1, 2]), (g if keep else None)


def _to_btk(x):
  """Reshapes [B, d1, ..., dm, K] to [B, T, K] with T = d1 * ... * dm."""
  x = tf.convert_to_tensor(x)
  k = _static_dim(x, -1)
  if x.shape.rank == 2:
    return x[:, None, :]
  return tf.reshape(x, [tf.shape(x)[0], -1, k if k is not None else
                        tf.shape(x)[-1]])


def _sqr_sum(x):
  x = tf.cast(x, tf.float32)
  return tf.reduce_sum(tf.square(tf.reshape(x, [tf.shape(x)[0], -1])), axis=1)


def _bias_grad(dz, bias_shape):
  """Per-example gradient of a bias broadcast (right-aligned) onto dz: dz
  summed over the axes the bias is broadcast along ([B] + non-1 bias dims)."""
  r, k = dz.shape.rank, len(bias_shape)
  axes = [j for j in range(1, r)
          if j < r - k or bias_shape[j - (r - k)] == 1]
  dz = tf.cast(dz, tf.float32)
  return record_sum(tf.reduce_sum(dz, axis=axes) if axes else dz)


def _plain_layer(layer):
  return (not getattr(layer, "lora_enabled", False) and
          getattr(layer, "quantization_mode", None) is None)


def _trainable(v):
  return v is not None and v.trainable


# ---------------------------------------------------------------------------
# Dense: z = x W + b; grad W_i = sum_t x_t dz_t^T, grad b_i = sum_t dz_t.


@_supports_records
def dense_norm_fn(layer, inputs, training=None):
  del training
  if not _plain_layer(layer):
    return None
  x = inputs
  return _kernel_bias_layer(layer, ops.matmul(x, layer.kernel),
                            lambda dz: _factored_sqr_norm(_to_btk(x), _to_btk(dz)))


def _kernel_bias_layer(layer, z, kernel_part):
  """Adds bias and activation to z = f(x, W); per-example ||grad W||^2 + ||grad b||^2.

  Shared by Dense and EinsumDense: `kernel_part(dz) -> (sqr_norms [B], g or None)`
  is the kernel's part, g its per-example gradient when materialized.
  """
  if layer.bias is not None:
    z = ops.add(z, layer.bias)
  outputs = layer.activation(z) if layer.activation is not None else z
  kernel_on, bias_on = _trainable(layer.kernel), _trainable(layer.bias)

  def sqr_norm_fn(dz):
    sq = _zeros(dz)
    grads = {}
    if kernel_on:
      sq_k, g = kernel_part(dz)
      sq += sq_k
      if g is not None:
        grads[id(layer.kernel)] = g
    if bias_on:
      db = _bias_grad(dz, layer.bias.shape)
      sq += _sqr_sum(db)
      grads[id(layer.bias)] = db
    return _result(layer, sq, grads)

  return outputs, z, sqr_norm_fn


# ---------------------------------------------------------------------------
# EinsumDense: z = einsum(eq, x, W) + b; per-example grad W_i by the einsum
# "in,out->b ker" (sums over every index but the batch and kernel indices).


def _parse_einsum(equation):
  eq = equation.replace(" ", "")
  if "..." in eq or "->" not in eq or "," not in eq:
    return None
  lhs, out = eq.split("->")
  inp, ker = lhs.split(",")
  if not inp or inp[0] != out[:1] or inp[0] in ker:
    return None
  if len(set(inp)) != len(inp) or len(set(ker)) != len(ker):
    return None
  if any(c not in inp and c not in out for c in ker):
    return None
  return inp, ker, out


@_supports_records
def einsum_dense_norm_fn(layer, inputs, training=None):
  del training
  if not _plain_layer(layer):
    return None
  parsed = _parse_einsum(layer.equation)
  if parsed is None:
    return None
  inp, ker, out = parsed
  x = inputs

  keep = _keep(int(np.prod(layer.kernel.shape)))

  def kernel_part(dz):
    g = record_sum(tf.einsum(f"{inp},{out}->{inp[0]}{ker}", tf.cast(x, tf.float32),
                              tf.cast(dz, tf.float32)))
    return _sqr_sum(g), (g if keep else None)

  return _kernel_bias_layer(layer, ops.einsum(layer.equation, x, layer.kernel),
                            kernel_part)


# ---------------------------------------------------------------------------
# Embedding: z_t = E[id_t]; grad E_i = sum_t e_{id_t} dz_t^T, so
# ||grad E_i||^2 = sum_{t,s} [id_t == id_s] <dz_t, dz_s> (repeated ids add up).


@_supports_records
def embedding_norm_fn(layer, inputs):
  if not _plain_layer(layer):
    return None
  ids = inputs
  if ids.dtype not in (tf.int32, tf.int64):
    ids = tf.cast(ids, tf.int32)
  z = tf.gather(layer.embeddings, ids)
  outputs = ops.cast(z, layer.compute_dtype)

  def sqr_norm_fn(dz):
    dz = tf.cast(dz, tf.float32)
    b = tf.shape(ids)[0]
    flat_ids = ids[:, None] if ids.shape.rank == 1 else tf.reshape(ids, [b, -1])
    d = _regroup_btk(_to_btk(dz) if ids.shape.rank > 1 else dz[:, None, :])
    flat_ids = _regroup_btk(flat_ids[:, :, None])[:, :, 0]
    if _static_dim(flat_ids, 1) == 1:
      return _sqr_sum(d)
    same = tf.cast(tf.equal(flat_ids[:, :, None], flat_ids[:, None, :]),
                   tf.float32)
    gd = tf.einsum("btd,bsd->bts", d, d)
    return tf.reduce_sum(same * gd, axis=[1, 2])

  return outputs, z, sqr_norm_fn


# ---------------------------------------------------------------------------
# Conv1D / Conv2D (channels_last, groups=1): unfold the input into patches
# P_i [T, kh*kw*cin]; grad W_i = P_i^T dz_i, grad b_i = sum_t dz_t.


def _conv_forward(layer, x, padding):
  z = ops.conv(x, layer.kernel, strides=list(layer.strides), padding=padding,
               dilation_rate=layer.dilation_rate,
               data_format=layer.data_format)
  if layer.use_bias:
    z = ops.add(z, ops.reshape(layer.bias, (1,) * (layer.rank + 1) +
                               (layer.filters,)))
  outputs = layer.activation(z) if layer.activation is not None else z
  return z, outputs


def _conv_accepts(layer):
  return (_plain_layer(layer) and layer.data_format == "channels_last" and
          getattr(layer, "groups", 1) == 1)


@functools.lru_cache(maxsize=None)
def _onednn_enabled():
  """Whether TF's oneDNN CPU kernels are on (TF_ENABLE_ONEDNN_OPTS)."""
  try:
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
    return bool(_pywrap_util_port.IsMklEnabled())
  except (ImportError, AttributeError):
    return False


# Batch-as-channels per-example filter gradients replicate dz over the input
# channels: at most this many entries per example.
_MAX_DEPTHWISE_ENTRIES = 1 << 16


def _per_example_filter_grads(x4, dz4, kernel_size, strides, padding, form):
  """Per-example filter gradients [B, kh, kw, cin, cout] (dilation 1).

  form "depthwise": one depthwise filter gradient with the batch moved into
  the channels (Rochette et al. 2019, Sec. 3): input [1, H, W, B cin],
  output gradient [1, H', W', B cin cout] (dz_i repeated over cin).
  form "filter": Conv2DBackpropFilter per example (tf.vectorized_map).
  Both beat the unfold when the output has more positions than a patch has
  entries (e.g. 8x8x1 kernels on 28x28 images); which of the two is faster
  depends on the CPU kernels (oneDNN or not, BENCHMARKS.md).
  """
  kh, kw = kernel_size
  cin, cout = int(x4.shape[-1]), int(dz4.shape[-1])
  x4 = tf.cast(x4, tf.float32)
  dz4 = tf.cast(dz4, tf.float32)
  if form == "depthwise" and strides[0] == strides[1]:  # TF's CPU kernel
    b = tf.shape(x4)[0]
    h, w = tf.shape(x4)[1], tf.shape(x4)[2]
    ho, wo = tf.shape(dz4)[1], tf.shape(dz4)[2]
    xt = tf.reshape(tf.transpose(x4, [1, 2, 0, 3]), [1, h, w, b * cin])
    dt = tf.transpose(dz4, [1, 2, 0, 3])[:, :, :, None, :]
    dt = tf.broadcast_to(dt, [ho, wo, b, cin, cout])
    dt = tf.reshape(dt, [1, ho, wo, b * cin * cout])
    g = tf.compat.v1.nn.depthwise_conv2d_native_backprop_filter(
        xt, tf.stack([kh, kw, b * cin, cout]), dt,
        [1, strides[0], strides[1], 1], padding.upper())
    g = tf.reshape(g, [kh, kw, b, cin, cout])
    return tf.transpose(g, [2, 0, 1, 3, 4])

  def one(pair):
    xi, di = pair
    return tf.compat.v1.nn.conv2d_backprop_filter(
        xi[None], [kh, kw, cin, cout], di[None], [1, strides[0], strides[1], 1],
        padding.upper())

  return tf.vectorized_map(one, (x4, dz4))


def _conv_sqr_norm_fn(layer, patches_fn, x4=None, dz4_fn=None, padding=None):
  """x4/dz4_fn/padding: the 2-D view used by the per-example filter path."""
  kernel_on = _trainable(layer.kernel)
  bias_on = layer.use_bias and _trainable(layer.bias)
  ksize = tuple(layer.kernel_size) if len(layer.kernel_size) == 2 else (
      1, layer.kernel_size[0])
  stride = tuple(layer.strides) if len(layer.strides) == 2 else (
      1, layer.strides[0])
  dilated = any(d != 1 for d in layer.dilation_rate)
  keep = _keep(int(np.prod(layer.kernel.shape)))

  def sqr_norm_fn(dz):
    sq = _zeros(dz)
    grads = {}
    if kernel_on:
      positions = int(np.prod(dz.shape[1:-1])) if None not in dz.shape[
          1:-1] else 0
      patch = ksize[0] * ksize[1] * int(x4.shape[-1])
      form = _FORM_OVERRIDE
      if form is None and positions > patch and not dilated:
        small = positions * int(x4.shape[-1]) * layer.filters <= (
            _MAX_DEPTHWISE_ENTRIES)
        form = "depthwise" if small and _onednn_enabled() else "filter"
      if form in ("filter", "depthwise") and not dilated:
        g = record_sum(_per_example_filter_grads(x4, dz4_fn(dz), ksize,
                                                  stride, padding, form))
        sq_k, g = _sqr_sum(g), (g if keep else None)
      else:
        sq_k, g = _factored_sqr_norm(_to_btk(patches_fn()), _to_btk(dz))
      sq += sq_k
      if g is not None:
        grads[id(layer.kernel)] = g
    if bias_on:
      db = _bias_grad(dz, (layer.filters,))
      sq += _sqr_sum(db)
      grads[id(layer.bias)] = db
    return _result(layer, sq, grads)

  return sqr_norm_fn


@_supports_records
def conv2d_norm_fn(layer, inputs):
  if not _conv_accepts(layer):
    return None
  x = inputs
  z, outputs = _conv_forward(layer, x, layer.padding)
  kh, kw = layer.kernel_size
  sh, sw = layer.strides
  dh, dw = layer.dilation_rate

  def patches_fn():
    return tf.image.extract_patches(
        tf.cast(x, tf.float32), sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1],
        rates=[1, dh, dw, 1], padding=layer.padding.upper())

  return outputs, z, _conv_sqr_norm_fn(layer, patches_fn, x, lambda dz: dz,
                                       layer.padding)


@_supports_records
def conv1d_norm_fn(layer, inputs):
  if not _conv_accepts(layer):
    return None
  x = inputs
  padding = layer.padding
  if padding == "causal":
    x = ops.pad(x, layer._compute_causal_padding())  # pylint: disable=protected-access
    padding = "valid"
  z, outputs = _conv_forward(layer, x, padding)
  (k,), (s,), (d,) = layer.kernel_size, layer.strides, layer.dilation_rate

  def patches_fn():
    p = tf.image.extract_patches(
        tf.cast(x, tf.float32)[:, None], sizes=[1, 1, k, 1],
        strides=[1, 1, s, 1], rates=[1, 1, d, 1], padding=padding.upper())
    return p[:, 0]

  return outputs, z, _conv_sqr_norm_fn(layer, patches_fn, x[:, None],
                                       lambda dz: dz[:, None], padding)


# ---------------------------------------------------------------------------
# LayerNormalization: y = xhat * gamma + beta; grad gamma_i = sum dy * xhat,
# grad beta_i = sum dy (sums over the non-normalized, non-batch axes).


@_supports_records
def layer_norm_norm_fn(layer, inputs):
  if getattr(layer, "rms_scaling", False):
    return None
  x = inputs
  ndims = x.shape.rank
  axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
  axes = sorted(a % ndims for a in axes)
  xhat = ops.layer_normalization(x, None, None, axes, layer.epsilon)
  bshape = [1] * ndims
  for a in axes:
    bshape[a] = x.shape[a]
  y = xhat
  gamma = layer.gamma if layer.scale else None
  beta = layer.beta if layer.center else None
  if gamma is not None:
    y = y * ops.cast(ops.reshape(gamma, bshape), xhat.dtype)
  if beta is not None:
    y = y + ops.cast(ops.reshape(beta, bshape), xhat.dtype)
  outputs = ops.cast(y, layer.compute_dtype)
  red = [a for a in range(1, ndims) if a not in axes]
  keep = _keep(int(np.prod(bshape)))

  def sqr_norm_fn(dy):
    dy = tf.cast(dy, tf.float32)
    sq = _zeros(dy)
    grads = {}
    if _trainable(gamma):
      g = dy * tf.cast(xhat, tf.float32)
      g = record_sum(tf.reduce_sum(g, axis=red) if red else g)
      sq += _sqr_sum(g)
      grads[id(gamma)] = g
    if _trainable(beta):
      g = record_sum(tf.reduce_sum(dy, axis=red) if red else dy)
      sq += _sqr_sum(g)
      grads[id(beta)] = g
    return _result(layer, sq, grads) if keep else sq

  return outputs, y, sqr_norm_fn


register_layer(keras.layers.Dense, dense_norm_fn)
register_layer(keras.layers.EinsumDense, einsum_dense_norm_fn)
register_layer(keras.layers.Embedding, embedding_norm_fn)
register_layer(keras.layers.Conv1D, conv1d_norm_fn)
register_layer(keras.layers.Conv2D, conv2d_norm_fn)
register_layer(keras.layers.LayerNormalization, layer_norm_norm_fn)

