"""Ghost norms of Keras 3's built-in LoRA (`layer.enable_lora(rank)` on Dense,
EinsumDense and Embedding; Hu et al. 2021, Sec. 4.1).

Keras merges the adapter into the kernel: W = W0 + s A B with s = alpha / rank,
A: kernel.shape[:-1] + (r,), B: (r, kernel.shape[-1]), and W0 frozen. With
G_i = d L_i / d W the per-example gradient of the merged kernel (never formed):

    grad A_i = s G_i B^T        grad B_i = s A^T G_i        (grad W0_i = G_i)

Dense (z = x W + b, G_i = sum_t x_t dz_t^T): grad A_i = sum_t x_t (s dz_t B^T)^T
and grad B_i = sum_t (s x_t A)(dz_t)^T, two factored products of rank-r factors
(algebra.factored_sqr_norm). EinsumDense: the same contractions written as one
einsum of x, dz and B (or A). Embedding (z_t = W[id_t], G_i = sum_t e_{id_t} dz_t^T):
grad A_i = sum_t e_{id_t} (s dz_t B^T)^T, a lookup-table norm (rules/tables.py),
and grad B_i = sum_t (s A[id_t]) dz_t^T, a factored product.

The layer's forward is Keras's (merged kernel, cast to the compute dtype), so
the watched tensor z is the one the model computes; the clipped sum of A and B
is the vector-Jacobian product through the merge, as in non-private training.
The dispatching functions at the end serve a layer with or without LoRA. The entry
checks, bias and activation are the plain rules' (rules/dense.py: `kernel_rule_entry`,
`lora_base`, `bias_and_parts`).
"""

import numpy as np
import tensorflow as tf
from keras import ops

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import dense
from tf_dpiter.keras.fast_clipping.rules import embedding
from tf_dpiter.keras.fast_clipping.rules import tables

_F32 = tf.float32


def _scale(layer):
  return float(layer.lora_alpha) / float(layer.lora_rank)


def _merged(base, a, b, scale, dtype):
  """Keras's merged LoRA weight W0 + s A B, in `dtype` (the compute dtype in the
  forward pass, float32 in the float32 recomputation)."""
  return ops.cast(ops.add(base, scale * ops.matmul(a, b)), dtype)


def _part(g):
  """(sqr_norms, g if kept else None) of a per-record gradient g [B/k, ...]."""
  keep = registry.keep_per_example(int(np.prod(g.shape[1:])) if g.shape[1:].is_fully_defined()
                                   else None)
  return algebra.sqr_sum(g), (g if keep else None)


@registry.float32_watched
@registry.supports_records
def dense_lora_norm_fn(layer, inputs, training=None):
  """Norm function (registry contract) of keras.layers.Dense with LoRA on.

  Args:
    layer: the layer being called.
    inputs: the call's input tensor(s) [B, ...].
    training: the call's training flag.

  Returns:
    (outputs, watched, sqr_norm_fn) as in the registry module's contract, or None where
    this rule does not apply to the layer.
  """
  del training
  entry = dense.kernel_rule_entry(layer, lora=True)
  if entry is None:
    return None
  base, _ = entry
  a_var, b_var, s, x = layer.lora_kernel_a, layer.lora_kernel_b, _scale(layer), inputs
  z = ops.matmul(x, _merged(base, a_var, b_var, s, x.dtype))

  # The rank-r factors v = s dZ B^T and u = s X A, formed once per dz and read by both the
  # norms and the clipped sum: a product that cancels (B's rows nearly orthogonal to dz) is
  # rounded once, so the sum weights the very factor whose norm was taken (formed again from
  # c dZ, its rounding moved one record's contribution to 1.9 C).
  factors = {}

  def rank_factors(dz):
    key = dz.ref() if tf.is_tensor(dz) else id(dz)
    if key not in factors:
      xb, dzb = tf.cast(algebra.to_btk(x), _F32), tf.cast(algebra.to_btk(dz), _F32)
      v = (s * tf.einsum("btn,rn->btr", dzb, tf.cast(b_var, _F32))
           if algebra.trainable(a_var) else None)
      u = (s * tf.einsum("btk,kr->btr", xb, tf.cast(a_var, _F32))
           if algebra.trainable(b_var) else None)
      factors[key] = (xb, dzb, v, u)
    return factors[key]

  def parts(dz):
    xb, dzb, v, u = rank_factors(dz)
    out = {}
    if v is not None:
      out[id(a_var)] = algebra.factored_sqr_norm(xb, v)
    if u is not None:
      out[id(b_var)] = algebra.factored_sqr_norm(u, dzb)
    if algebra.trainable(base):
      out[id(base)] = algebra.factored_sqr_norm(xb, dzb)
    return out

  def sums(dz, c):   # sum_i c_i g_i of the kernel side: rank-r products, never W-sized
    xb, dzb, v, u = rank_factors(dz)
    out = {}
    if v is not None:     # X^T (C V), V = s dZ B^T
      out[id(a_var)] = tf.einsum("btk,btr->kr", algebra.drop_rows(xb, c),
                                 algebra.weight_rows(v, c))
    if u is not None:     # U^T (C dZ), U = s X A
      out[id(b_var)] = tf.einsum("btr,btn->rn", algebra.drop_rows(u, c),
                                 algebra.weight_rows(dzb, c))
    if algebra.trainable(base):
      out[id(base)] = tf.einsum("btk,btn->kn", algebra.drop_rows(xb, c),
                                algebra.weight_rows(dzb, c))
    return out

  return _with_factor_sums(layer, dense.bias_and_parts(layer, z, parts), sums)


def _with_factor_sums(layer, res, kernel_sums):
  """The LoRA rule's (outputs, watched, sqr_norm_fn) whose sqr_norm_fn returns
  registry.FactorSums (unless it kept every per-example gradient): the clipped sum from the
  clip factors, `kernel_sums(dz, c)` -> {id(variable): sum} of the kernel side and the bias's
  sum_i c_i grad b_i, instead of a vector-Jacobian product through the merged kernel (a tape
  gradient per layer, which traces a backward pass through the network below the layer)."""
  outputs, z, sqr_norm_fn = res

  def sums(dz, c):
    out = kernel_sums(dz, c)
    if algebra.trainable(layer.bias):   # from the db whose norm was taken (bias_and_parts)
      out[id(layer.bias)] = sqr_norm_fn.bias_sum(dz, c)
    return [out[id(v)] for v in layer.trainable_variables]

  def norms_and_sums(dz):
    res = sqr_norm_fn(dz)
    if isinstance(res, (registry.PerExampleGrads, registry.PerExampleBlock)):
      return res
    return registry.FactorSums(res, lambda c: sums(dz, c))

  return outputs, z, norms_and_sums


def _free_char(equation):
  return next(c for c in "zyxwvutsrqponmlkjihgfedcba" if c not in equation)


@registry.float32_watched
@registry.supports_records
def einsum_dense_lora_norm_fn(layer, inputs, training=None):
  """Norm function (registry contract) of keras.layers.EinsumDense with LoRA on.

  Args:
    layer: the layer being called.
    inputs: the call's input tensor(s) [B, ...].
    training: the call's training flag.

  Returns:
    (outputs, watched, sqr_norm_fn) as in the registry module's contract, or None where
    this rule does not apply to the layer.
  """
  del training
  entry = dense.kernel_rule_entry(layer, lora=True, einsum=True)
  if entry is None:
    return None
  base, (inp, ker, out) = entry
  r, e, rest, b = _free_char(layer.equation), ker[-1], ker[:-1], inp[0]
  a_var, b_var, s, x = layer.lora_kernel_a, layer.lora_kernel_b, _scale(layer), inputs
  z = ops.einsum(layer.equation, x, _merged(base, a_var, b_var, s, x.dtype))

  # the rank-r factors, as in dense_lora_norm_fn: v = s dz B^T (out's axis e made r) and
  # u = s x A (inp's kernel axes made r), formed once per dz and read by the norms and the sum
  out_r = out.replace(e, r)
  inp_r = ("".join(ch for ch in inp if ch not in rest) +
           "".join(ch for ch in rest if ch not in inp) + r)
  factors = {}

  def rank_factors(dz):
    key = dz.ref() if tf.is_tensor(dz) else id(dz)
    if key not in factors:
      xf, dzf = tf.cast(x, _F32), tf.cast(dz, _F32)
      v = (s * tf.einsum(f"{out},{r}{e}->{out_r}", dzf, tf.cast(b_var, _F32))
           if algebra.trainable(a_var) else None)
      u = (s * tf.einsum(f"{inp},{rest}{r}->{inp_r}", xf, tf.cast(a_var, _F32))
           if algebra.trainable(b_var) else None)
      factors[key] = (xf, dzf, v, u)
    return factors[key]

  def parts(dz):
    xf, dzf, v, u = rank_factors(dz)
    grads = {}
    if v is not None:     # sum x v: s * sum_e G[..., e] B[r, e]
      grads[id(a_var)] = _part(algebra.record_sum(
          tf.einsum(f"{inp},{out_r}->{b}{rest}{r}", xf, v)))
    if u is not None:     # sum u dz: s * sum_rest A[rest, r] G[rest, e]
      grads[id(b_var)] = _part(algebra.record_sum(
          tf.einsum(f"{inp_r},{out}->{b}{r}{e}", u, dzf)))
    if algebra.trainable(base):
      g = tf.einsum(f"{inp},{out}->{b}{ker}", xf, dzf)
      grads[id(base)] = _part(algebra.record_sum(g))
    return grads

  def sums(dz, c):   # sum_i c_i g_i of the kernel side: the same contractions without b
    xf, dzf, v, u = rank_factors(dz)
    out_sums = {}
    if v is not None:
      out_sums[id(a_var)] = tf.einsum(f"{inp},{out_r}->{rest}{r}", algebra.drop_rows(xf, c),
                                      algebra.weight_rows(v, c))
    if u is not None:
      out_sums[id(b_var)] = tf.einsum(f"{inp_r},{out}->{r}{e}", algebra.drop_rows(u, c),
                                      algebra.weight_rows(dzf, c))
    if algebra.trainable(base):
      out_sums[id(base)] = tf.einsum(f"{inp},{out}->{ker}", algebra.drop_rows(xf, c),
                                     algebra.weight_rows(dzf, c))
    return out_sums

  return _with_factor_sums(layer, dense.bias_and_parts(layer, z, parts), sums)


@registry.float32_watched
@registry.supports_records
def embedding_lora_norm_fn(layer, inputs):
  """Norm function (registry contract) of keras.layers.Embedding with LoRA on
  (also the lookup call of a LoRA ReversibleEmbedding)."""
  base = dense.lora_base(layer, "_embeddings")
  if base is None:
    return None
  a_var, b_var, s = layer.lora_embeddings_a, layer.lora_embeddings_b, _scale(layer)
  ids = inputs if inputs.dtype in (tf.int32, tf.int64) else tf.cast(inputs, tf.int32)
  table = ops.add(base, s * ops.matmul(a_var, b_var))
  z = tf.gather(table, ids)
  outputs = ops.cast(z, layer.compute_dtype)

  def sqr_norm_fn(dz):
    flat = tables.flat_ids(ids)
    d = algebra.to_btk(tf.cast(dz, _F32))
    sq = algebra.zeros(dz)
    # the factors v = s dz B^T and s A[ids] whose norms are taken are the ones the clipped sum
    # weights (registry.FactorSums; the tape's product of the summed rows with B^T rounded a
    # cancelling projection again and moved one record's contribution to 1.5 C)
    v = rows = None
    if algebra.trainable(a_var):
      v = s * tf.einsum("btd,rd->btr", d, tf.cast(b_var, _F32))
      sq += tables.same_id_sqr_norm(flat, v)
    if algebra.trainable(b_var):
      rows = s * tf.gather(tf.cast(a_var, _F32), flat)
      sq += algebra.factored_sqr_norm(rows, d)[0]
    if algebra.trainable(base):
      sq += tables.same_id_sqr_norm(flat, d)

    def sum_fn(c):
      by_table_row = lambda t: tf.math.unsorted_segment_sum(   # sum_t e_{id_t} t_t^T
          tf.reshape(algebra.weight_rows(t, c), [-1, t.shape[-1]]), tf.reshape(flat, [-1]),
          layer.input_dim)
      out = {}
      if v is not None:
        out[id(a_var)] = by_table_row(v)
      if rows is not None:
        out[id(b_var)] = tf.einsum("btr,btd->rd", algebra.drop_rows(rows, c),
                                   algebra.weight_rows(d, c))
      if algebra.trainable(base):
        out[id(base)] = by_table_row(d)
      return [out[id(w)] if id(w) in out else tf.zeros(w.shape, _F32)
              for w in layer.trainable_variables]

    return registry.FactorSums(sq, sum_fn)

  return outputs, z, sqr_norm_fn


def _dispatch(plain_fn, lora_fn):
  """The norm function of a layer class: lora_fn when LoRA is on, else plain_fn."""

  def norm_fn(layer, *args, **kwargs):
    fn = lora_fn if getattr(layer, "lora_enabled", False) else plain_fn
    return fn(layer, *args, **kwargs)

  norm_fn.__name__ = plain_fn.__name__ + "_or_lora"
  norm_fn.__doc__ = (f"{plain_fn.__name__} without LoRA, {lora_fn.__name__} with LoRA on "
                     "(registry contract).")
  for flag in ("supports_records", "float32_watched", "float32_sums"):
    if getattr(plain_fn, flag, False) and getattr(lora_fn, flag, False):
      setattr(norm_fn, flag, True)
  norm_fn.lora_variants = (plain_fn, lora_fn)   # registry.lookup picks one per layer
  return norm_fn


dense_norm_fn = _dispatch(dense.dense_norm_fn, dense_lora_norm_fn)
einsum_dense_norm_fn = _dispatch(dense.einsum_dense_norm_fn, einsum_dense_lora_norm_fn)
embedding_norm_fn = _dispatch(embedding.embedding_norm_fn, embedding_lora_norm_fn)
