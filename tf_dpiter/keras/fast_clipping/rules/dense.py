"""Ghost norms of Dense and EinsumDense.

Dense: z = x W + b; grad W_i = sum_t x_t dz_t^T, grad b_i = sum_t dz_t; its clipped sum
(registry.FactorSums) weights the smaller of x and dz by the clip factors and takes one
matrix product over every position of every example, the bias one reduction of the
weighted output gradient. When both W and b are trained and x has positions t, b is the
weight of a constant input 1 (z = [x, 1] [W; b]) in the norms: the norm of [W; b] is that
of one kernel on [x, 1], so the bias needs no pass of its own over dz (in the Gram form its
squared norm is sum_{t,s} <dz_t, dz_s>, from the Gram already formed).
EinsumDense: z = einsum(eq, x, W) + b. Where it is a Dense on [B, T, K] inputs (its kernel
the contracted then the output-only indices, its bias one value per output-only entry, e.g.
BERT's attention projections; `_as_dense`) it takes the Dense forms above; else per-example
grad W_i by the einsum "in,out->b ker" (sums over every index but the batch and kernel
indices).
The entry checks and the bias/activation wrapper serve the LoRA rules too (rules/lora.py).
Memory budget (rules/budget.py): on [B, T.., K] inputs both run their per-example
forms (per-example gradients, Gram matrices) and their clipped sums over chunks of the batch
whose temporaries take at most budget.CHUNK_BYTES, and keep per-record gradients for the
clipped sum only while the batch's take at most budget.KEEP_BYTES (beyond: the norms, and the
sum from the clip-weighted output gradients, Bu et al., "Differentially private optimization
on large model at small cost", Sec. 3).
"""

import numpy as np
import tensorflow as tf
from keras import ops

from tf_dpiter.dp_query import summation
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import budget


@registry.float32_watched
@registry.supports_records
@registry.watched_from_inputs
def dense_norm_fn(layer, inputs, training=None):
  """Norm function (registry contract) of keras.layers.Dense.

  Args:
    layer: the layer being called.
    inputs: the call's input tensor(s) [B, ...].
    training: the call's training flag.

  Returns:
    (outputs, watched, sqr_norm_fn) as in the registry module's contract, or None where
    this rule does not apply to the layer.
  """
  del training
  if kernel_rule_entry(layer, lora=False) is None:
    return None
  # which of W and b are trained: read once here and handed to the helpers below
  on = (layer.kernel.trainable, layer.bias is not None and layer.bias.trainable)
  x = inputs
  z = ops.matmul(x, layer.kernel)
  if on[0] and x.shape.rank is not None and x.shape.rank > 2:
    # the memory budget applies (rules/budget.py): x has positions ([B, T.., K]) and the
    # kernel is trained (the bias then folded in when it is trained too, or frozen)
    outputs, z = _add_bias_and_activation(layer, z)
    return outputs, z, lambda dz: _budgeted_norms(layer, on, x, dz)
  outputs, z, sqr_norm_fn = bias_and_parts(
      layer, z, lambda dz: {id(layer.kernel): algebra.factored_sqr_norm(
          algebra.to_btk(x), algebra.to_btk(dz), sums_from_g=True)} if on[0] else {},
      bias_on=on[1])

  def norms_and_sums(dz):
    res = sqr_norm_fn(dz)
    if isinstance(res, (registry.PerExampleGrads, registry.PerExampleBlock)):
      return res
    if isinstance(algebra.RECORDS.k, int) and algebra.RECORDS.k == 1 and x.shape.rank == 2:
      # one term per record: the pinned sum
      return registry.FactorSums(res, lambda c: _pinned_dense_sums(layer, x, dz, c, on))
    return registry.FactorSums(res, lambda c: _dense_sums(
        layer, x, dz, c, on, bias_sum=lambda c: sqr_norm_fn.bias_sum(dz, c)))

  return outputs, z, norms_and_sums


def _budgeted_norms(layer, on, x, dz):
  """The norms and clipped sum of a Dense layer on [B, T.., K] inputs within the memory
  budget (rules/budget.py): ||[grad W; grad b]||^2 per record as one kernel on [x, 1] (or
  grad W alone with a frozen bias) by budget.factored_sqr_norms, over chunks of the batch.
  Per-record gradients kept within budget.KEEP_BYTES are one registry.PerExampleBlock (summed
  once, then split into the kernel's K rows and the bias's last row); else the clipped sum is
  registry.FactorSums: the book-keeping product (_dense_sums) over chunks of at most
  budget.CHUNK_BYTES of temporaries, or (a batch the trace does not know) the choice at run
  time.

  Args:
    layer: the Dense layer.
    on: (kernel trained, bias trained), the kernel trained.
    x: [B, T.., K] its input.
    dz: [B, T.., N] the gradient at its output before the activation.

  Returns:
    registry.PerExampleBlock or registry.FactorSums.
  """
  fold = _bias_folded(on, x)
  rows, n = int(x.shape[-1]) + int(fold), int(dz.shape[-1])
  t = algebra.static_positions(x.shape[1:-1])
  m = budget.examples_per_chunk(x, 4 * 2 * t * (rows + n)) if t != -1 else None
  # the direct form's norm covers the rounding of a record's terms in the book-keeping
  # product over chunks of m examples (algebra.with_sum_rounding; the two-pass variant's
  # backward pass sums the batch's B t rows, covered only where B <= m)
  # sq handed on unchanged: its Gram form's bound may be formed with its class's
  # (algebra.batched_norms)
  with algebra.deferred_norms():
    sq, keep, g = budget.factored_sqr_norms(
        algebra.to_btk(x), algebra.to_btk(dz), with_one=fold,
        sum_rows=budget.chunk_rows(x, m, t) if t != -1 else None)

  def unpack(sums):
    parts = (tf.split(sums[0], algebra.const([(rows - 1) * n, n]), num=2, axis=algebra.const(0))
             if fold else [sums[0]])
    by_id = {id(v): algebra.shaped(p, v) for v, p in zip((layer.kernel, layer.bias), parts)}
    return [by_id[id(v)] for v in layer.trainable_variables]

  if keep is True:
    return registry.PerExampleBlock(sq, [algebra.leading_rows(g, sq)], unpack)
  shapes = [v.shape for v in layer.trainable_variables]
  k = algebra.current_examples_per_record()   # the sums run outside the norms' records context
  pinned = PINNED_RECORD_SUMS and isinstance(k, int)

  def by_bookkeeping(c):
    if pinned:
      sums = _pinned_record_sums(x, dz, c, fold, k, rows - int(fold), n)
      by_id = {id(v): algebra.shaped(p, v) for v, p in zip((layer.kernel, layer.bias), sums)}
      return [by_id[id(v)] for v in layer.trainable_variables]
    return budget.sum_over_chunks(lambda xc, dc, cc: _dense_sums(layer, xc, dc, cc, on),
                                  (x, dz, c), m, shapes)

  def from_kept(c):
    record_c = budget.record_factors(c, k)
    return unpack([budget.pinned_kept_sum(record_c, g) if pinned else
                   budget.kept_sum(record_c, g)])

  def sum_fn(example_factors):
    c = tf.cast(example_factors, tf.float32)
    if pinned:   # one term per record in either branch: blocks of one record
      for v in layer.trainable_variables:
        algebra.report_pinned(v, 1)
    return budget.by_keep(keep, lambda: from_kept(c), lambda: by_bookkeeping(c))

  sum_fn.keeps_per_example = keep   # a bool, or a scalar bool tensor for an unknown batch
  return registry.FactorSums(sq, sum_fn)


# True: the clipped sum of a Dense layer on [B, T.., K] inputs whose per-record gradients are
# not kept is formed record by record in a pinned order (`_pinned_record_sums`) and charged the
# plan's shrink; False (the default): the book-keeping product over the batch's B T rows, an
# order no one pins, charged no margin (the cross-record rounding stays open there: 1.054 C
# measured, tests/privacy/test_sum_rounding_review.py). Not the default: BERT-base (B 4,
# T 32, graph mode, A/B alternated at load 5) took 2278 ms a step with it against 1878 and
# peaked at 2337 MiB RSS against 1875 (1.35x the non-private run's, 1.08x without; the TF
# allocator's peak 629 MiB against 638), its first step 20.6 CPU s against 15.2.
PINNED_RECORD_SUMS = False
# Bytes of one block of `_pinned_record_sums`' per-record gradients (a few of the kernel's
# rows for a chunk of records): small, since the sums of every layer may run at once.
RECORD_BLOCK_BYTES = 1 << 20


def _pinned_record_sums(x, dz, factors, fold, k, kk, n):
  """sum_j c_j g_j of a Dense layer on [B, T.., K] inputs (its kernel, and its bias, the
  weight of an input 1, with `fold`) where the per-record gradients are not kept, in a pinned
  order: each record's float32 gradient g~_j = [x_j, 1]^T (c_j dz_j) formed over its own k T
  positions (the kernel's by a batched product, einsum "btk,btn->bkn", the bias's by a
  reduction: any order within the record, from its rows alone), the records' gradients
  summed by budget.pinned_sum_over_records (chunks of a power of two of records, each chunk
  by summation.pairwise_sum, the chunks by a pinned tree in a tf.while_loop: one chunk's
  gradients alive at a time). The book-keeping product over the batch's B T rows
  (`_dense_sums`) adds the terms x_t dz_t^T of every record in one order no one pins: a record whose positions' terms are large and cancel (its gradient near
  0, its clip factor 1) carries partial sums whose rounding the added or removed record
  changes, so the sum moved by more than C (Casacuberta et al., "Widespread underestimation
  of sensitivity in differentially private libraries and how to fix it", CCS 2022; 1.054 C
  measured, tests/privacy/test_sum_rounding_review.py). Here every record is one term,
  c_j g~_j, whose norm is at most the clip: g~_j is within gamma_{kT + 1} S_j of the exact
  gradient (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., Sec. 3.1;
  S_j = sum_t ||[x_t, 1]|| ||dz_t||), which the norm's raise covers (algebra.with_sum_rounding,
  L >= kT + 1); so the plan of summation.rounding_margin with blocks of one record applies
  (reported by the caller: algebra.report_pinned) and the step's shrink keeps the sum's move
  within C. Memory: the records' gradients are formed a block of the kernel's rows at a time
  (tf.map_fn over blocks of kb rows, kb a divisor of K where one is near the budget, so that
  the blocks' sums are the kernel in place; each block's entries are summed by their own
  tree, the rounding analysis being per entry), chunks of r records, within
  RECORD_BLOCK_BYTES: at BERT-base's shapes (B 4, N 768) blocks of 64 rows of the four
  records. Cost: the product's multiply-adds (B T (K + 1) N) as before, in per-record products
  of k T terms, plus writing and adding the B records' gradients. Rows with c_j = 0 are exactly 0
  (algebra.weight_rows / drop_rows), padding rows too.

  Args:
    x: [B, T.., K] the layer's input.
    dz: [B, T.., N] the gradient at its output before the activation.
    factors: [B] float32 clip factors of each example's record.
    fold: the bias folded in (`_bias_folded`): its sum too.
    k: examples per record (a Python int).
    kk, n: K and N.

  Returns:
    [the kernel's sum [K N] float32] and with `fold` the bias's [N].
  """
  t = algebra.static_positions(x.shape[1:-1])
  weight_x = kk < n   # the kernel's factors on the smaller operand (dz at K = N)
  x3 = tf.cast(algebra.to_btk(x), tf.float32)
  xw = (algebra.weight_rows if weight_x else algebra.drop_rows)(x3, factors)
  dw = algebra.weight_rows(algebra.to_btk(dz), factors)
  dk = algebra.drop_rows(algebra.to_btk(dz), factors) if weight_x else dw
  # [R, k T, K] and [R, k T, N]: a record's rows together
  lead = [-1, k * t] if t != -1 else [tf.shape(xw)[0] // k, -1]
  xr = tf.reshape(xw, lead + [kk])
  dr = tf.reshape(dk, lead + [n])
  kt = k * t if t != -1 else tf.shape(xr)[1]
  records = xr.shape[0]
  # records per chunk and the kernel's rows per block (a divisor of K where one is near the
  # budget: the blocks' sums are then the kernel in place, no copy): a block's gradients
  # within RECORD_BLOCK_BYTES, whatever the layer's size (the layers' sums may run at once)
  r = budget.records_per_pinned_chunk(4 * n, cap=records or (1 << 30),
                                      budget_bytes=RECORD_BLOCK_BYTES)
  limit = max(1, min(kk, RECORD_BLOCK_BYTES // (4 * n * r)))
  kb = max(d for d in range(1, limit + 1) if kk % d == 0)
  kb = kb if 4 * kb >= limit else limit
  nb = -(-kk // kb)

  def block_sum(xb):   # [R, k T, kb] -> [kb N]: the records' gradients' rows of this block
    return budget.pinned_sum_over_records(
        lambda xc, dc: tf.reshape(tf.einsum("btk,btn->bkn", xc, dc), [-1, kb * n]),
        (xb, dr), 1, r, kb * n)

  if nb == 1:
    kernel = block_sum(xr)
  else:
    padded = tf.pad(xr, [[0, 0], [0, 0], [0, nb * kb - kk]]) if nb * kb > kk else xr
    blocks = tf.transpose(tf.reshape(padded, [tf.shape(padded)[0], kt, nb, kb]), [2, 0, 1, 3])
    sums = tf.map_fn(block_sum, blocks, parallel_iterations=1,
                     fn_output_signature=tf.TensorSpec([kb * n], tf.float32))
    kernel = tf.reshape(sums, [-1])
    kernel = kernel if nb * kb == kk else kernel[:kk * n]
  if not fold:
    return [kernel]
  # the bias: each record's sum of its c dz_t (the weight of an input 1), the records by
  # the same pinned tree
  db = tf.reshape(dw, lead + [n])
  rb = budget.records_per_pinned_chunk(4 * n * (k * t + 1 if t != -1 else 2),
                                       cap=records or (1 << 30),
                                       budget_bytes=RECORD_BLOCK_BYTES)
  bias = budget.pinned_sum_over_records(lambda dc: tf.reduce_sum(dc, 1), (db,), 1, rb, n)
  return [kernel, bias]


def _bias_folded(on, x):
  """The bias is taken as the weight of an input 1: both the kernel and the bias are trained
  (`on`: (kernel trained, bias trained)) and x has positions ([B, T.., K]), where the bias's
  gradient is a sum over them. For a [B, K] input it is dz itself, and the extra column would
  only copy x."""
  return on[0] and on[1] and x.shape.rank is not None and x.shape.rank > 2


def _dense_sums(layer, x, dz, factors, on=None, bias_sum=None):
  """sum_i c_i g_i of a Dense layer, float32: kernel (c * x)^T dz or x^T (c * dz), one matrix
  product of the [B T.., K] and [B T.., N] rows of every position (whichever of x and dz is
  smaller gets the factors, dz at K = N); an EinsumDense that is a Dense (`_as_dense`) too,
  on its [B, T, K] and [B, T, N] views: at BERT-base's attention shapes (B 4, K = N = 768)
  the einsum "abc,abde->cde" took 1.08x (sequence 128) to 1.35x (sequence 32) the process
  CPU of this product; bias sum_i c_i sum_t dz_t, a reduction of the weighted output
  gradient (Bu et al., "Differentially private optimization on large model at small cost",
  Sec. 3). The bias is not the last row of a product on [x, 1] here (as it is in the norms,
  `_budgeted_norms`): at BERT-base's shapes and sequence 128 the einsum on [x, 1] (K + 1
  rows) took 1.2-1.35x the CPU of the K-row product and the bias's reduction, about the same
  at sequence 32 (benchmarks/dense_sum_forms.py), and this form needs no copy of x with a
  column of ones. Rows with c_i = 0 are exactly 0 in both operands (algebra.weight_rows /
  drop_rows: one elementwise op each, no branch), so a record whose values are not finite
  adds nothing.
  `on`: (kernel trained, bias trained) where the caller has read it (None: read here).
  `bias_sum`: callable(factors) -> the bias's sum, from the per-record db whose norm was taken
  (bias_and_parts' bias_sum), where the norm is not of the bias folded into the kernel."""
  if on is None:
    on = (algebra.trainable(layer.kernel), algebra.trainable(layer.bias))
  k, n = int(x.shape[-1]), int(dz.shape[-1])
  out = {}
  # the factors on the smaller operand (on dz at K = N: the bias is then one reduction of the
  # weighted dz); the bias reads dz weighted where dz carries them
  dz_weighted = on[0] and k >= n
  if on[0]:
    if dz_weighted:
      xw, dw = algebra.drop_rows(x, factors), algebra.weight_rows(dz, factors)
    else:
      xw, dw = algebra.weight_rows(x, factors), algebra.drop_rows(dz, factors)
    # [B T.., K]^T [B T.., N]: one product over every position (a reshape of contiguous rows)
    product = tf.matmul(algebra.reshape(xw, [-1, k]), algebra.reshape(dw, [-1, n]),
                        transpose_a=True)
    out[id(layer.kernel)] = algebra.shaped(product, layer.kernel)
  if on[1] and bias_sum is not None:
    out[id(layer.bias)] = bias_sum(factors)
  elif on[1]:
    if dz_weighted:   # c_i dz_i: summed over the batch and the positions, one reduction
      out[id(layer.bias)] = algebra.shaped(
          algebra.reduce_sum(dw, list(range(dw.shape.rank - 1))), layer.bias)
    else:
      dz = algebra.drop_rows(dz, factors)
      per_example = dz if dz.shape.rank == 2 else tf.reduce_sum(   # [B, N] already: no op
          tf.reshape(dz, [tf.shape(dz)[0], -1, n]), axis=1)
      out[id(layer.bias)] = algebra.shaped(algebra.factor_product(factors, per_example), layer.bias)
  return [out[id(v)] for v in layer.trainable_variables]


def _pinned_dense_sums(layer, x, dz, factors, on):
  """sum_i c_i g_i of a Dense layer on [B, K] inputs with one example per record, in a pinned
  order (algebra.pinned_rows_product: blocks of algebra.pinned_block rows, any order within a
  block, the blocks by a pairwise tree), declared by algebra.report_pinned so that the step
  charges the rounding margin of that plan (dp_query/summation.rounding_margin) and the sum
  moves by at most C when a record is added or removed (Casacuberta et al., "Widespread
  underestimation of sensitivity in differentially private libraries and how to fix it",
  CCS 2022). Each record's kernel term x_i (c_i dz_i)^T is one outer product, so its terms'
  absolute values are bounded by its norm. Kernel (c x)^T dz or x^T (c dz) (the factors on the
  smaller operand, as `_dense_sums`); bias sum_i c_i dz_i, the same pinned product with the
  factors as a [B, 1] operand. Rows of c_i = 0 add exactly 0 (algebra.drop_rows). The block
  is algebra.pinned_block's, raised to at most the largest block the step's sums reported
  before (algebra.raised_block: fewer leaves for a small layer, the same clip shrink)."""
  k, n = int(x.shape[-1]), int(dz.shape[-1])
  out = {}
  block = algebra.pinned_block(algebra.plan_rows(x.shape[0]), 4 * (k * n if on[0] else n), budget.CHUNK_BYTES,
                               small_bytes=algebra.PINNED_SMALL_BYTES)
  block = algebra.raised_block(block)   # the step's shrink unchanged: at most its block
  if on[0]:
    if k >= n:
      xw, dw = algebra.drop_rows(x, factors), algebra.weight_rows(dz, factors)
    else:
      xw, dw = algebra.weight_rows(x, factors), algebra.drop_rows(dz, factors)
    out[id(layer.kernel)] = algebra.shaped(algebra.pinned_rows_product(xw, dw, block), layer.kernel)
    algebra.report_pinned(layer.kernel, block)
  if on[1]:
    c = tf.reshape(tf.cast(factors, tf.float32), [-1, 1])
    out[id(layer.bias)] = algebra.shaped(
        algebra.pinned_rows_product(c, algebra.drop_rows(dz, factors), block), layer.bias)
    algebra.report_pinned(layer.bias, block)
  return [out[id(v)] for v in layer.trainable_variables]


def bias_and_parts(layer, z, parts_fn, bias_on=None):
  """Adds bias and activation to z; the norm function sums the kernel side's parts and the
  bias's ||grad b_i||^2 (grad b_i: dz summed over the axes the bias is broadcast along,
  `algebra.bias_sqr_norm`: an upper bound covering its terms' rounding unless every
  per-record gradient is kept, the clipped sum then formed from this grad b_i).

  Shared by the plain Dense/EinsumDense rules (one part: W) and their LoRA rules (W0, A, B).

  Args:
    layer: a Dense or EinsumDense layer, plain or with LoRA on.
    z: the kernel side's output f(x, W) [B, ..., units], before the bias.
    parts_fn: callable(dz) -> {id(variable): (sqr_norms [B/k], g or None)} over the
      trainable kernel-side variables; g is the per-record gradient when materialized.
    bias_on: whether the bias is trained, where the caller has read it (None: read here).

  Returns:
    (outputs, watched, sqr_norm_fn) as in the registry module's contract (watched: z + b).
  """
  outputs, z = _add_bias_and_activation(layer, z)
  if bias_on is None:
    bias_on = algebra.trainable(layer.bias)
  dbs = {}   # dz -> the per-record db whose norm was taken (its clipped sum: bias_sum)

  def sqr_norm_fn(dz):
    sq, grads = None, {}
    for vid, (sq_v, g) in parts_fn(dz).items():
      sq = algebra.add_norms(sq, sq_v)
      if g is not None:
        grads[vid] = g
    if bias_on:
      # the clipped sum of the bias is formed from this db (PerExampleGrads, or bias_sum):
      # its float32 norm needs no bound
      sq_b, db = algebra.bias_sqr_norm(dz, layer.bias.shape, sum_from_db=True)
      dbs[dz.ref() if tf.is_tensor(dz) else id(dz)] = (db, algebra.RECORDS.k)
      sq = algebra.add_norms(sq, sq_b)
      grads[id(layer.bias)] = db
    return algebra.result(layer, algebra.zeros(dz) if sq is None else sq, grads)

  def bias_sum(dz, example_factors):
    """sum_j c_j db_j of the db whose norm sqr_norm_fn took for dz (called after it)."""
    return _db_sum(layer, *dbs[dz.ref() if tf.is_tensor(dz) else id(dz)], example_factors)

  sqr_norm_fn.bias_sum = bias_sum
  return outputs, z, sqr_norm_fn


def _db_sum(layer, db, k, example_factors):
  """sum_j c_j db_j over the records' bias gradients db [B / k, ...] (the very ones whose
  norms were taken: a bias's per-record gradient is a float32 sum of its terms, and a sum
  formed by another reduction of c dz rounds them another way, which where they nearly
  cancel let one record move the clipped sum by more than C), shaped as the bias; a record
  of factor 0 adds exactly 0 (budget.kept_sum); k the records' examples when db was formed.
  A two-row product over B / k rows of the bias's entries: cheaper than the reduction of
  c dz over the batch's positions."""
  p = int(np.prod(layer.bias.shape))
  flat = db if db.shape.rank == 2 else algebra.reshape(db, [-1, p])
  record_c = budget.record_factors(tf.cast(example_factors, tf.float32), k)   # the norm's k
  return algebra.shaped(budget.kept_sum(record_c, flat), layer.bias)


def _add_bias_and_activation(layer, z):
  """(outputs, z + b): the layer's activation of z + b (b if the layer has one)."""
  if layer.bias is not None:
    z = ops.add(z, layer.bias)
  return (layer.activation(z) if layer.activation is not None else z), z


def lora_base(layer, name):
  """The stored (un-merged) weight W0 of a plain LoRA layer (LoRA on, not quantized).

  Args:
    layer: a Keras layer.
    name: the attribute of the stored weight ("_kernel", "_embeddings").

  Returns:
    the variable, or None where a LoRA rule declines the layer (LoRA off, or quantized).
  """
  if not getattr(layer, "lora_enabled", False):
    return None
  if getattr(layer, "quantization_mode", None) is not None:
    return None
  return getattr(layer, name, None)


def kernel_rule_entry(layer, lora, einsum=False):
  """The entry checks of the Dense and EinsumDense rules, plain (here) and LoRA (rules/lora.py).

  Args:
    layer: a Dense or EinsumDense layer.
    lora: False for a plain rule: the layer must be neither LoRA nor quantized
      (`algebra.plain_layer`); True for a LoRA rule: LoRA on and not quantized (`lora_base`).
    einsum: True for EinsumDense: the equation must be one these rules support (two
      operands, no ellipsis, no repeated index, the batch index first in the input and the
      output and not in the kernel, every kernel index in the input or the output).

  Returns:
    None where the rule declines the layer, else (kernel, parsed): kernel the weight the rule
    differentiates (`layer.kernel` plain, the stored frozen base W0 with LoRA), parsed the
    (input, kernel, output) subscripts of the equation, or None without `einsum`.
  """
  if lora:
    kernel = lora_base(layer, "_kernel")
    if kernel is None:
      return None
  elif algebra.plain_layer(layer):
    kernel = layer.kernel
  else:
    return None
  parsed = _parse_einsum(layer.equation) if einsum else None
  if einsum and parsed is None:
    return None
  return kernel, parsed


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


@registry.float32_watched
@registry.supports_records
@registry.watched_from_inputs
def einsum_dense_norm_fn(layer, inputs, training=None):
  """Norm function (registry contract) of keras.layers.EinsumDense.

  Args:
    layer: the layer being called.
    inputs: the call's input tensor(s) [B, ...].
    training: the call's training flag.

  Returns:
    (outputs, watched, sqr_norm_fn) as in the registry module's contract, or None where
    this rule does not apply to the layer.
  """
  del training
  entry = kernel_rule_entry(layer, lora=False, einsum=True)
  if entry is None:
    return None
  _, (inp, ker, out) = entry
  x = inputs
  outputs, z = _add_bias_and_activation(layer, ops.einsum(layer.equation, x, layer.kernel))

  def norms(dz):
    view = _as_dense(layer, (inp, ker, out), x, dz)
    if view is not None:   # a Dense on [B, T, K]: its norms and its clipped sum
      return _budgeted_norms(layer, *view)
    return _einsum_norms(layer, (inp, ker, out), x, dz)

  return outputs, z, norms


def _as_dense(layer, equation, x, dz):
  """An EinsumDense layer as a Dense layer on [B, T, K] inputs, where it is one: its input's
  indices are the batch, positions (in the output, not the kernel) and contracted indices (in
  the kernel, not the output), in that order; its output's the batch, the same positions and
  the kernel's other indices; the kernel's the contracted then the output-only indices (so
  the kernel's entries are a [K, N] matrix in place); the kernel is trained; the bias, when
  trained, is one value per output-only entry; every size static. E.g. BERT's attention
  projections "abc,cde->abde" and "abcd,cde->abe". Then z = x W + b on x [B, T, K],
  z [B, T, N] (positions T, contracted K, output-only N entries), so the layer takes the
  Dense rule's forms: the Gram form of its norm (Li et al., "Large language models can be
  strong differentially private learners", Sec. 4, cost T^2 (K + N) per example in place of
  the per-example einsum's T K N), the bias folded in as the weight of an input 1, and one
  matrix product for the clipped sum.

  Args:
    layer: the EinsumDense layer.
    equation: (input, kernel, output) subscripts.
    x: [B, ...] its input.
    dz: [B, ...] the gradient at its output before the activation.

  Returns:
    (on, x3 [B, T, K], dz3 [B, T, N]) for _budgeted_norms, on = (True, bias trained), or None
    where the layer is not such a Dense.
  """
  inp, ker, out = equation
  if not algebra.trainable(layer.kernel):
    return None
  positions = [c for c in inp[1:] if c in out]
  contracted = [c for c in inp[1:] if c in ker and c not in out]
  out_only = [c for c in out[1:] if c in ker]
  if (not positions or not contracted or not out_only or
      list(inp[1:]) != positions + contracted or list(out[1:]) != positions + out_only or
      list(ker) != contracted + out_only):
    return None
  if not (x.shape[1:].is_fully_defined() and dz.shape[1:].is_fully_defined()):
    return None
  bias_on = algebra.trainable(layer.bias)
  n_shape = dz.shape[1 + len(positions):].as_list()
  if bias_on and list(layer.bias.shape) != n_shape:
    return None
  t = algebra.static_positions(x.shape[1:1 + len(positions)])

  def flat(v, last):
    return v if v.shape.as_list()[1:] == [t, last] else algebra.reshape(v, [-1, t, last])

  return ((True, bias_on), flat(x, algebra.static_positions(x.shape[1 + len(positions):])),
          flat(dz, algebra.static_positions(n_shape)))


def _einsum_kernel_norms(equation, x, dz, p):
  """Per-record squared norms of an EinsumDense kernel's gradient, by the per-example
  einsum "in,out->b ker" over chunks of the batch (rules/budget.py), and the per-record
  gradients where they are kept (budget.keep_choice; registry.keep_per_example without a
  budget). Where they are not, the clipped sum (_einsum_kernel_sum) rounds the record's terms
  another way and the norms are upper bounds covering both roundings
  (algebra.with_terms_rounding with S = ||sum |x| |dz|||_F per record, one more einsum: one
  record whose terms cancelled across its examples moved the sum by 17.8 C).

  Args:
    equation: (input, kernel, output) subscripts.
    x: [B, ...] the layer's input.
    dz: [B, ...] the gradient at its output before the bias.
    p: kernel entries (a Python int).

  Returns:
    (sqr_norms [B / k], keep, g [R, p] or None) as budget.factored_sqr_norms returns them.
  """
  inp, ker, out = equation
  x = tf.cast(x, tf.float32)
  dz = tf.cast(dz, tf.float32)
  size = lambda t: algebra.static_positions(t.shape[1:])
  k = algebra.current_examples_per_record()
  operands = (4 * (size(x) + size(dz)) * k
              if -1 not in (size(x), size(dz)) and isinstance(k, int) else 0)
  keep = budget.keep_choice(x, 4 * p, registry.keep_per_example(p), operands)
  m = (budget.examples_per_chunk(x, 4 * (2 * (size(x) + size(dz)) + 2 * p))
       if -1 not in (size(x), size(dz)) else None)
  rec = m // k if m is not None else None

  per_example = _einsum_terms(equation, x, dz)
  rows = algebra.sum_examples(x) * per_example   # the clipped sum's (_einsum_kernel_sum)
  terms = per_example * (k if isinstance(k, int) else tf.cast(k, tf.float32))

  def pass_of(with_g):
    def body(xc, dc):
      per_example_grad = f"{inp},{out}->{inp[0]}{ker}"
      g = algebra.reshape(algebra.record_sum(tf.einsum(per_example_grad, xc, dc)), [-1, p])
      sq = algebra.record_sqr_sums(g)
      if with_g:   # the clipped sum from this g: no bound
        return sq, g
      # the sum by _einsum_kernel_sum rounds the record's terms another way: the norm raised by
      # gamma_L ||sum |x| |dz|||_F (algebra.with_sum_rounding's bound, its S the Frobenius
      # norm of the entrywise bound itself), L = k P + B P + 1 (P terms per entry per example)
      bound = algebra.record_sum(tf.einsum(per_example_grad, tf.abs(xc), tf.abs(dc)))
      s = tf.sqrt(algebra.sqr_sum(bound))
      return (algebra.with_terms_rounding(sq, s, terms + rows + 1),)

    specs = [tf.TensorSpec([rec], tf.float32)] + (
        [tf.TensorSpec([rec, p], tf.float32)] if with_g else [])
    return budget.over_chunks(body, (x, dz), m, specs)

  # the unused [0, p] only where the choice is a run-time tf.cond (its branches must match)
  sq, g = budget.by_keep(keep, lambda: pass_of(True),
                         lambda: (pass_of(False)[0], None if keep is False else
                                  tf.zeros([0, p], tf.float32)))
  return sq, keep, None if keep is False else g


def _einsum_terms(equation, x, dz):
  """The products an entry of the per-example kernel gradient einsum("in,out->b ker") sums:
  the product of the sizes of the indices it contracts (neither the batch's nor the
  kernel's); a Python int where the trace knows them, else a float32 scalar tensor."""
  inp, ker, out = equation
  sizes = []
  for c in sorted((set(inp) | set(out)) - set(ker) - {inp[0]}):
    src, axis = (x, inp.index(c)) if c in inp else (dz, out.index(c))
    sizes.append(algebra.static_or_shape(src, axis))
  total = 1
  for d in sizes:
    total = total * d
  return total


def _einsum_norms(layer, equation, x, dz):
  """The norms and clipped sum of an EinsumDense layer within the memory budget
  (rules/budget.py): registry.PerExampleGrads where the per-record gradients are kept (or
  only the bias is trained), else registry.FactorSums whose kernel sum is the book-keeping
  einsum (_einsum_kernel_sum) over chunks of at most budget.CHUNK_BYTES of temporaries, or (a
  batch the trace does not know) chosen at run time; the bias's sum is always formed from the
  per-record db whose norm is taken (_db_sum: no bound needed).

  Args:
    layer: the EinsumDense layer.
    equation: (input, kernel, output) subscripts.
    x: [B, ...] its input.
    dz: [B, ...] the gradient at its output before the activation.

  Returns:
    registry.PerExampleGrads or registry.FactorSums.
  """
  kernel_on = algebra.trainable(layer.kernel)
  bias_on = algebra.trainable(layer.bias)
  p = int(np.prod(layer.kernel.shape))
  sq, keep, g = (_einsum_kernel_norms(equation, x, dz, p) if kernel_on else
                 (None, False, None))
  db = None
  if bias_on:   # the bias's clipped sum is formed from this db in every form (_db_sum)
    sq_b, db = algebra.bias_sqr_norm(dz, layer.bias.shape, sum_from_db=True)
    sq = algebra.add_norms(sq, sq_b)
  if sq is None:
    sq = algebra.zeros(dz)
  if keep is True or not kernel_on:
    grads = {id(layer.bias): db} if bias_on else {}
    if kernel_on:
      grads[id(layer.kernel)] = algebra.leading_rows(g, sq)
    return algebra.result(layer, sq, grads)
  size = lambda t: algebra.static_positions(t.shape[1:])
  m = (budget.examples_per_chunk(x, 4 * 2 * (size(x) + size(dz)))
       if -1 not in (size(x), size(dz)) else None)
  records_k = algebra.RECORDS.k   # the sums run outside the norms' records context

  def with_bias(kernel_sum, c):
    out = {id(layer.kernel): kernel_sum}
    if bias_on:
      out[id(layer.bias)] = _db_sum(layer, db, records_k, c)
    return [out[id(v)] for v in layer.trainable_variables]

  def by_bookkeeping(c):
    return with_bias(budget.sum_over_chunks(
        lambda xc, dc, cc: [_einsum_kernel_sum(equation, xc, dc, cc)], (x, dz, c), m,
        [layer.kernel.shape])[0], c)

  def from_kept(c):
    return with_bias(algebra.reshape(budget.kept_sum(budget.record_factors(c), g),
                                     layer.kernel.shape), c)

  def sum_fn(example_factors):
    c = tf.cast(example_factors, tf.float32)
    return budget.by_keep(keep, lambda: from_kept(c), lambda: by_bookkeeping(c))

  sum_fn.keeps_per_example = keep   # a bool, or a scalar bool tensor for an unknown batch
  return registry.FactorSums(sq, sum_fn)


def _einsum_kernel_sum(equation, x, dz, factors):
  """sum_i c_i grad W_i of an EinsumDense kernel, float32, as one einsum over the batch:
  einsum("in,out->ker", x, c * dz) (the bias's sum is formed from its per-record db,
  `_db_sum`). Rows with c_i = 0 are exactly 0 in both operands (algebra.weight_rows /
  drop_rows), so a record whose values are not finite adds nothing. No backward pass through
  the network (a tape gradient per layer would trace one)."""
  inp, ker, out = equation
  return tf.einsum(f"{inp},{out}->{ker}", algebra.drop_rows(x, factors),
                   algebra.weight_rows(dz, factors))
