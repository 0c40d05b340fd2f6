"""Clipped gradient sum with ghost norms (fast per-example clipping).

For a sample of B records (examples) with per-example losses L_i, returns

    sum_i g_i * min(1, C / ||g_i||_2),   g_i = d L_i / d theta,

(the clipped sum of McMahan et al. 2018, Sec. 2, pi_C) without materializing
g_i for registered layers: ||g_i||^2 is the sum over layers of per-layer
squared norms computed from the layer's inputs and the gradient at its output
(Goodfellow 2015; Li et al. 2021, Sec. 4). Trainable layers that are not
registered get vectorized per-example gradients for their own variables
(tf.vectorized_map); their squared norms are added to the ghost norms
(plan.py says which layer is which).

Two ways to form the clipped sum once the clip factors c_i are known:
  * "bookkeeping" (Bu et al. 2023, Sec. 3; summing.py): one backward pass to the layer
    outputs, then per layer the vector-Jacobian product with c_i * dz_i.
  * "two_pass" (Li et al. 2021): a second backward pass of sum_i c_i L_i.
Both are exact in float32; the default is the one measured faster
(BENCHMARKS.md). A registered layer whose norm function returns the per-example
gradients (registry.PerExampleGrads: small convolutions, LayerNorm) is summed
as sum_i c_i g_i instead of by a vector-Jacobian product.

Dtype policies. The norms, the clip factors and the clipped sum are
float32 whatever the compute dtype: the ghost products cast activations and
backprops to float32, and the vector-Jacobian product of a 16-bit layer is
taken through its norm function's float32 recomputation of the watched tensor
(registry.float32_watched), so the 16-bit model math is kept but no sum over
records is formed in 16 bits. Under float16 the summed loss is multiplied by a
static loss scale S (routing.loss_scale) and the norms and sums divided by it.
A record whose norm is not finite gets clip factor 0 and adds nothing, as on
the vectorized path (a function of that record alone). Only "bookkeeping" is
exact under 16-bit compute; "two_pass" is refused there.
"""

import numbers

import tensorflow as tf

from tf_dpiter import dp_query
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import runtime as routing  # oneDNN, XLA, loss scale (not the optimizer)
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import plan as plan_lib
from tf_dpiter.keras.fast_clipping import recording
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping import summing

GHOST = plan_lib.GHOST
VECTORIZED = plan_lib.VECTORIZED
DEFAULT_VARIANT = "bookkeeping"

_ZERO = tf.UnconnectedGradients.ZERO


def _check_clip(l2_norm_clip):
  if isinstance(l2_norm_clip, numbers.Number):
    if not (l2_norm_clip > 0 and l2_norm_clip < float("inf")):
      raise PrivacyConfigError(
          f"l2_norm_clip must be a positive finite number, got {l2_norm_clip}")
    return tf.constant(float(l2_norm_clip), tf.float32)
  return tf.cast(l2_norm_clip, tf.float32)


def _check_examples_per_record(k):
  """A positive int, or a scalar integer tensor (dynamic batch, > 0 by
  construction of the caller)."""
  if tf.is_tensor(k):
    static = tf.get_static_value(k)
    if static is None:
      return tf.cast(k, tf.int32)
    k = int(static)
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ParameterValueError(
        f"examples_per_record must be a positive integer, got {k!r}")
  return k


def _grouped(k):
  return tf.is_tensor(k) or k > 1


def _forward(model, units, inputs, targets, per_example_loss_fn, mask, k,
             scale):
  """The recorded forward pass and the loss (run it under a tape).

  Returns (outputs, raw_losses [B], losses [B] (weighted per record),
  record_mask [B/k], scaled_total)."""
  with recording.CALL_LOCK:
    installed = recording.install(units)
    try:
      outputs = model(inputs, training=True)
    finally:
      recording.uninstall(installed)
  raw_losses = tf.cast(per_example_loss_fn(targets, outputs), tf.float32)
  if raw_losses.shape.rank != 1:
    raise ParameterValueError(
        f"per_example_loss_fn must return a [B] tensor, got shape "
        f"{raw_losses.shape}")
  b_static = raw_losses.shape[0]
  if _grouped(k) and not tf.is_tensor(k) and b_static is not None and b_static % k:
    raise ParameterValueError(
        f"the batch of {b_static} examples is not a whole number of records "
        f"of examples_per_record={k}; pad it (with mask 0)")
  batch = tf.shape(raw_losses)[0]
  mask_f = (tf.ones([batch], tf.float32) if mask is None else
            tf.cast(tf.reshape(mask, [-1]), tf.float32))
  if not _grouped(k):
    record_mask = mask_f
    losses = raw_losses * mask_f if mask is not None else raw_losses
  else:
    # A record's loss is the mean loss of its real examples.
    count = tf.reduce_sum(tf.reshape(mask_f, [-1, k]), axis=1)
    record_mask = tf.cast(count > 0, tf.float32)
    losses = raw_losses * mask_f / tf.repeat(tf.maximum(count, 1.0), k)
  total = tf.reduce_sum(losses)
  return outputs, raw_losses, losses, record_mask, total * scale


def _sources(units):
  """Tensors of the first backward pass: the watched tensors of ghost units
  (ghost: (unit, start, n)) and the outputs of the other units' calls
  (vect: (unit, record, start, n)); sources is their concatenation."""
  ghost, vect, sources = [], [], []
  for u in units:
    if not u.records:
      continue
    if (u.kind == GHOST and len(u.records) == 1 and
        u.records[0]["watched"] is not None):
      w = tf.nest.flatten(u.records[0]["watched"])
      ghost.append((u, len(sources), len(w)))
      sources.extend(w)
    else:
      for rec in u.records:
        o = tf.nest.flatten(rec["outputs"])
        vect.append((u, rec, len(sources), len(o)))
        sources.extend(o)
  return ghost, vect, sources


def _sqr_norms(ghost, vect, src_grads, k, num_records):
  """Per-record squared norms [B/k] float32 (scaled by S^2 under a loss scale),
  the per-record gradients at hand ({id(unit): [g per variable] or a
  registry.PerExampleBlock}) and the sum functions of GhostSums and FactorSums results
  ({id(unit): sum_fn or the FactorSums})."""
  sq = None   # the first part is the running sum (no zeros tensor)
  per_example, normed, sum_fns = {}, set(), {}
  for u, start, n in ghost:
    rec = u.records[0]
    grads_w = tf.nest.pack_sequence_as(rec["watched"], src_grads[start:start + n])
    with registry.examples_per_record(k):
      res = rec["sqr_norm_fn"](grads_w)
    if isinstance(res, registry.PerExampleGrads):
      per_example[id(u)] = list(res.grads)
      normed.add(id(u))
      res = res.sqr_norms
    elif isinstance(res, registry.PerExampleBlock):
      per_example[id(u)] = res
      normed.add(id(u))
      res = res.sqr_norms
    elif isinstance(res, registry.GhostSums):
      sum_fns[id(u)] = res.sum_fn
      res = res.sqr_norms
    elif isinstance(res, registry.FactorSums):
      sum_fns[id(u)] = res
      res = res.sqr_norms
    sq = algebra.add_norms(sq, res)
  for u, rec, start, n in vect:
    g = recording.vectorized_grads(u, rec, src_grads[start:start + n])
    with registry.examples_per_record(k):
      g = [tf.cast(registry.record_sum(t), tf.float32) for t in g]
    if id(u) in per_example:
      per_example[id(u)] = [a + b for a, b in zip(per_example[id(u)], g)]
    else:
      per_example[id(u)] = g
  for uid, gs in per_example.items():
    if uid in normed:
      continue
    for g in gs:
      sq = algebra.add_norms(sq, algebra.sqr_sum(g))
  if sq is None:
    sq = tf.zeros([num_records], tf.float32)
  return sq, per_example, sum_fns


def _clip_factors(sq, clip_factors_fn, record_mask, scale, masked):
  """(norms, factors): ||g_j|| and the clip factors c_j = clip_factors_fn(||g_j||) (the
  DPQuery's rule: `DPQuery.record_clip_factors`), 0 for a masked record; float32, without
  gradient."""
  norms = tf.sqrt(tf.maximum(sq, 0.0)) / scale
  factors = tf.cast(clip_factors_fn(norms), tf.float32)
  if masked:
    factors = factors * record_mask
  return norms, tf.stop_gradient(factors)


def gaussian_clip_factors(l2_norm_clip):
  """The factor function of the Gaussian sum query's clip: norms -> min(1, C / norms), 0 for
  a non-finite norm (`tf_dpiter.dp_query.clip_factors`).

  Args:
    l2_norm_clip: C > 0, finite (a number or a float tensor).

  Returns:
    a callable [R] float32 norms -> [R] float32 factors.

  Raises:
    PrivacyConfigError: C is a number that is not positive and finite.
  """
  clip = _check_clip(l2_norm_clip)
  return lambda norms: dp_query.clip_factors(norms, clip)


def _factors_fn(l2_norm_clip, clip_factors_fn):
  """The clip factor function from exactly one of (l2_norm_clip, clip_factors_fn)."""
  if (l2_norm_clip is None) == (clip_factors_fn is None):
    raise PrivacyConfigError(
        "give exactly one of l2_norm_clip and clip_factors_fn, got "
        f"l2_norm_clip={l2_norm_clip!r}, clip_factors_fn={clip_factors_fn!r}")
  if clip_factors_fn is None:
    return gaussian_clip_factors(l2_norm_clip)
  if not callable(clip_factors_fn):
    raise ParameterTypeError(f"clip_factors_fn must be callable, got {clip_factors_fn!r}")
  return clip_factors_fn


def _check_variant(variant, scale):
  if variant not in ("bookkeeping", "two_pass"):
    raise ParameterValueError(f"variant must be 'bookkeeping' or 'two_pass', got "
                              f"{variant!r}")
  if scale != 1.0 and variant == "two_pass":
    raise ParameterValueError("variant='two_pass' is not supported under a loss scale "
                              f"({scale}); use variant='bookkeeping'")


def _clipped_grad_sum(model, inputs, targets, per_example_loss_fn,
                      l2_norm_clip=None, mask=None, variant=DEFAULT_VARIANT,
                      examples_per_record=1, return_outputs=False,
                      clip_factors_fn=None):
  """Implementation of clipped_grad_sum with a choice of `variant`."""
  factors_fn = _factors_fn(l2_norm_clip, clip_factors_fn)
  k = _check_examples_per_record(examples_per_record)
  units = plan_lib.plan(model, grouped=_grouped(k))
  scale = routing.loss_scale(model)
  _check_variant(variant, scale)

  with tf.GradientTape(persistent=True) as tape, tf.name_scope("forward"):
    outputs, raw_losses, losses, record_mask, total = _forward(
        model, units, inputs, targets, per_example_loss_fn, mask, k, scale)

  # First backward pass: gradients at the watched tensors of ghost units and
  # at the outputs of vectorized units (one pass through the network).
  # Name scopes: the phases of the traced graph (op counts and profiles by phase).
  ghost, vect, sources = _sources(units)
  with tf.name_scope("backward_to_layers"):
    src_grads = tape.gradient(total, sources, unconnected_gradients=_ZERO)
  with tf.name_scope("norms"):
    num_records = tf.shape(raw_losses)[0] // k
    sq, per_example, sum_fns = _sqr_norms(ghost, vect, src_grads, k, num_records)
    norms, factors = _clip_factors(sq, factors_fn, record_mask, scale,
                                   mask is not None or _grouped(k))
    example_factors = tf.repeat(factors, k) if _grouped(k) else factors

  with tf.name_scope("clipped_sum"):
    if variant == "two_pass":
      result = summing.two_pass_sum(units, losses, example_factors, tape)
    else:
      result = summing.bookkeeping_sum(units, ghost, sources, src_grads, per_example,
                                       sum_fns, factors / scale, example_factors / scale, tape)
  del tape
  out = summing.dense_result(model, result)
  if return_outputs:
    return out, norms, outputs, raw_losses
  return out, norms


# Not converted by AutoGraph (no tensor-dependent Python control flow): converting the
# library's functions made most of a large model's trace time.
@tf.autograph.experimental.do_not_convert
def clipped_grad_sum(model, inputs, targets, per_example_loss_fn,
                     l2_norm_clip=None, mask=None, examples_per_record=1,
                     return_outputs=False, clip_factors_fn=None,
                     variant=DEFAULT_VARIANT):
  """Sum over records of per-record gradients clipped to L2 norm C.

  Computes sum_j g_j * c_j with c_j = min(1, C / ||g_j||_2) (McMahan et al.
  2018, Sec. 2, pi_C, flat clipping over all trainable variables), or with the
  factors c_j = clip_factors_fn(||g_j||) of a DPQuery (the DP models pass
  `query.record_clip_factors(params, .)`: the query clips by its own rule,
  whichever way the norms were obtained). A record is one example
  (examples_per_record=1) or k consecutive examples (a microbatch: rows
  j*k ... j*k + k - 1), whose gradient g_j is that of the mean loss of its
  real examples. Ghost norms for registered layers, vectorized per-example
  gradients for the others. No noise. Norms, clip factors and the sum are
  float32 under every dtype policy (module docstring).

  Args:
    model: a built keras.Model; model(inputs, training=True) is run once.
    inputs, targets: a batch of B examples (leading axis); B a multiple of k.
    per_example_loss_fn: (y_true, y_pred) -> [B] per-example losses.
    l2_norm_clip: C > 0, in units of the gradient L2 norm (or None with
      clip_factors_fn).
    mask: optional [B] 0/1; rows with 0 contribute nothing. A record with no
      real example has norm 0.
    examples_per_record: k, a positive integer.
    return_outputs: also return the model outputs and the [B] losses.
    clip_factors_fn: instead of l2_norm_clip, a callable [B / k] float32
      norms -> [B / k] factors in [0, 1] (a record with a non-finite norm must
      get 0), e.g. `lambda n: query.record_clip_factors(params, n)`.
    variant: "bookkeeping" (one backward pass, the default) or "two_pass" (a
      second backward pass of sum_j c_j L_j; not under a loss scale or 16-bit
      layers). Both give the same sum.

  Returns:
    (grads, per_record_norms[, outputs, losses]): grads is a list of dense
    tensors aligned with model.trainable_variables (float32 for 16-bit
    variables, else the variable's dtype); per_record_norms is
    [B / k] float32, ||g_j||_2 before clipping (not finite for a record whose
    gradient is not: that record adds nothing).

  Raises:
    ParameterTypeError: clip_factors_fn is not callable.
    ParameterValueError: not exactly one of l2_norm_clip and clip_factors_fn, bad
      l2_norm_clip, variant or examples_per_record, a batch that is not
      whole records, a loss that is not [B], or a model that cannot be clipped
      per example (see supports).
  """
  return _clipped_grad_sum(model, inputs, targets, per_example_loss_fn,
                           l2_norm_clip, mask=mask, variant=variant,
                           examples_per_record=examples_per_record,
                           return_outputs=return_outputs,
                           clip_factors_fn=clip_factors_fn)
