"""Ghost norm of a lookup-table gradient (shared by the LoRA embedding and the
position-embedding rules).

A table T read at rows id_t with a gradient d_t at each read position has the
per-example gradient G_i = sum_t e_{id_t} d_t^T, so

    ||G_i||_F^2 = sum_{t,s} [id_t == id_s] <d_t, d_s>

(repeated rows add up; Lee & Kifer 2021, Sec. 3, for embeddings).
"""

import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping.rules import budget


def same_id_sqr_norm(ids, d):
  """Per-record ||sum_t e_{id_t} d_t^T||^2 for ids [B, T] (int), d [B, T, K].

  Records of k consecutive examples (algebra.examples_per_record) merge their positions.
  The [T, T] matrices of equal ids and of the d Gram are formed over chunks of the batch
  whose temporaries take at most budget.CHUNK_BYTES (rules/budget.py), one chunk at a time.

  Args:
    ids: [B, T] integer ids.
    d: [B, T, K] gradients at the read positions.

  Returns:
    [B/k] float32 upper bounds (exact to float32 rounding where no gradients cancel) that
    also cover the clipped sum's rounding of the record's terms (a scatter of c d over the
    batch's B T reads; with one read per record, T = k = 1, the norm is exact to a relative
    rounding and nothing can cancel).
  """
  d = tf.cast(d, tf.float32)
  k = algebra.current_examples_per_record()
  if algebra.static_dim(ids, 1) == 1 and isinstance(k, int) and k == 1:
    return algebra.sqr_sum(d)
  t, kk = algebra.static_dim(d, 1), algebra.static_dim(d, 2)
  m = (budget.examples_per_chunk(d, 4 * (2 * t * kk + 4 * k * t * t))
       if None not in (t, kk) and isinstance(k, int) else None)

  def body(ic, dc):
    dc = algebra.regroup_btk(dc)
    if not (isinstance(k, int) and k == 1):
      ic = algebra.regroup_btk(ic[:, :, None])[:, :, 0]
    same = tf.cast(tf.equal(tf.expand_dims(ic, algebra.const(2)),
                            tf.expand_dims(ic, algebra.const(1))), tf.float32)
    # an upper bound: the float32 Gram of d cancels when equal ids get opposite gradients
    # (algebra.gram_sqr_norm); `same` is exact
    nd = tf.sqrt(tf.reduce_sum(tf.square(dc), 2))
    # sum_rows: the clipped sum (the scatter of c d_t onto the rows read, over the batch's
    # B T reads) rounds the record's terms too, a_t = e_{id_t}: S = sum_t ||d_t|| (na = 1)
    return (algebra.bounded_gram_contraction(same, tf.einsum("btk,bsk->bts", dc, dc),
                                             tf.ones_like(nd), nd, 0,
                                             algebra.static_or_shape(dc, 2), rows),)

  rows = algebra.batch_rows(d)
  rec = m // k if m is not None else None
  return budget.over_chunks(body, (ids, d), m, [tf.TensorSpec([rec], tf.float32)])[0]


def flat_ids(ids):
  """ids [B] or [B, d1, ...] -> [B, T] int32 (T = 1 for [B]).

  Args:
    ids: integer ids [B] or [B, d1, ...].

  Returns:
    [B, T] int32.
  """
  if ids.dtype not in (tf.int32, tf.int64):
    ids = tf.cast(ids, tf.int32)
  if ids.shape.rank == 1:
    return tf.expand_dims(ids, algebra.const(1))
  if ids.shape.rank == 2:   # [B, T] already: no op
    return ids
  return tf.reshape(ids, [tf.shape(ids)[0], algebra.static_positions(ids.shape[1:])])
