"""The clipped sum of fast clipping once the clip factors c_i are known (see clipping.py).

sum_i c_i g_i over the variables of the recorded units, in float32 for 16-bit variables:
"bookkeeping" (Bu et al. 2023, Sec. 3: per ghost unit the vector-Jacobian product of its
watched tensors with the clip-weighted backprops, per vectorized unit sum_i c_i g_i of its
per-example gradients) or "two_pass" (Li et al. 2021: a second backward pass of
sum_i c_i L_i).
"""

import keras
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.internals import keras_internals
from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import plan as plan_lib
from tf_dpiter.keras.fast_clipping import registry

_ZERO = tf.UnconnectedGradients.ZERO


def _dense(g):
  return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def sum_dtype(v):
  """dtype of a variable's clipped sum: float32 for 16-bit variables."""
  dtype = tf.as_dtype(v.dtype)
  return tf.float32 if dtype.is_floating and dtype.size < 4 else dtype


def _float32_vjp(unit, weighted):
  """sum_i c_i g_i of a 16-bit ghost unit in float32: the norm function is run
  again on the float32 inputs with every variable read as a watched float32
  copy (keras.StatelessScope), and its watched tensors are differentiated."""
  rec = unit.records[0]   # its floating inputs cast to float32, non-finite -> 0
  args, kwargs = tf.nest.map_structure(
      lambda t: algebra.finite_float32(t) if tf.is_tensor(t) and t.dtype.is_floating else t,
      (rec["args"], rec["kwargs"]))
  w32 = [tf.cast(tf.convert_to_tensor(v), tf.float32) for v in unit.variables]
  with tf.GradientTape() as tape:
    tape.watch(w32)
    with keras.StatelessScope() as scope:
      # Set after construction: the constructor would cast the values to the
      # variables' (16-bit) dtype.
      keras_internals.map_variables(scope, unit.variables, w32)
      watched = tf.nest.flatten(unit.norm_fn(unit.layer, *args, **kwargs)[1])
  bad = [w.dtype.name for w in watched if w.dtype != tf.float32]
  if bad:
    raise ParameterValueError(
        f"the norm function of layer {unit.layer.name!r} is marked "
        f"float32_watched but returned watched tensors of dtype {bad}")
  return tape.gradient(watched, w32, output_gradients=weighted,
                       unconnected_gradients=_ZERO)


def _ghost_vjp(unit, watched, grads_w, example_factors, tape, sum_fn=None):
  """sum_i c_i g_i of a ghost unit: the rule's own sum (FactorSums, GhostSums), else the
  vector-Jacobian product of the watched tensors with the clip-weighted
  gradients, in float32 for 16-bit layers."""
  if isinstance(sum_fn, registry.FactorSums):
    return [_dense(g) for g in sum_fn.sum_fn(example_factors)]
  # g * c per row (float32), 0 where c == 0 (even if g is not finite)
  weighted = [algebra.weight_rows(g, example_factors) for g in grads_w]
  if sum_fn is not None:
    grads = sum_fn(tf.nest.pack_sequence_as(unit.records[0]["watched"], weighted))
  elif unit.float32_recompute:
    grads = _float32_vjp(unit, weighted)
  else:
    weighted = [tf.cast(w, t.dtype) for w, t in zip(weighted, watched)]
    grads = tape.gradient(watched, keras_internals.gradient_sources(unit.variables),
                          output_gradients=weighted,
                          unconnected_gradients=_ZERO)
  return [_dense(g) for g in grads]


def _rows_sum(g, factors):
  """sum_i c_i g_i over the rows of a per-record tensor g [R, ...] (float32): one matrix
  product of the rows with c = 0 set to 0 first (algebra.drop_rows: a non-finite g_i adds
  nothing; one elementwise op, no branch)."""
  return algebra.factor_product(factors, algebra.drop_rows(g, factors))


def _per_example_sums(grads, factors):
  """The clipped sums of a unit whose per-record gradients are at hand (a list aligned
  with its variables, or a registry.PerExampleBlock)."""
  if isinstance(grads, registry.PerExampleBlock):
    return list(grads.unpack([_rows_sum(b, factors) for b in grads.blocks]))
  return [_rows_sum(g, factors) for g in grads]


def bookkeeping_sum(units, ghost, sources, src_grads, per_example, sum_fns,
                    factors, example_factors, tape):
  """{id(variable): clipped sum} by book-keeping (module docstring).

  A record with c = 0 (its norm not finite, or masked) adds exactly nothing: every sum
  zeroes its rows (algebra.weight_rows / drop_rows), with no branch on finiteness.

  Args:
    units: the plan's units.
    ghost: (unit, start, n) of the ghost units, their watched tensors at sources[start:start+n].
    sources: the tensors of the first backward pass.
    src_grads: the gradients of the summed loss at `sources`.
    per_example: {id(unit): per-record gradients (a list per variable, or a
      registry.PerExampleBlock)}.
    sum_fns: {id(unit): a GhostSums sum function or a registry.FactorSums}.
    factors: [R] float32 clip factors c per record (divided by the loss scale).
    example_factors: [B] float32, each example's record's c (divided by the loss scale).
    tape: the persistent tape of the forward pass.

  Returns:
    {id(variable): clipped sum tensor}.
  """
  result = {}
  for u, start, n in ghost:
    if id(u) in per_example:
      continue
    grads = _ghost_vjp(u, sources[start:start + n], src_grads[start:start + n],
                       example_factors, tape, sum_fns.get(id(u)))
    for v, g in zip(u.variables, grads):
      result[id(v)] = tf.cast(g, sum_dtype(v))
  for u in units:
    if id(u) not in per_example:
      continue
    sums = _per_example_sums(per_example[id(u)], factors)
    for v, g in zip(u.variables, sums):
      result[id(v)] = tf.cast(g, sum_dtype(v))
  return result


def two_pass_sum(units, losses, example_factors, tape):
  """{id(variable): clipped sum} by a second backward pass of sum_i c_i L_i.

  Args:
    units: the plan's units; losses: [B] weighted losses; example_factors: [B] c_i;
    tape: the persistent tape of the forward pass.

  Returns:
    {id(variable): clipped sum tensor}.

  Raises:
    PrivacyConfigError: a unit computes in 16 bits.
  """
  if any(plan_lib.computes_in_16_bits(u.layer) for u in units):
    raise PrivacyConfigError("variant='two_pass' forms the clipped sum in the layers' "
                             "16-bit compute dtype; use variant='bookkeeping'")
  with tape:
    weighted = tf.reduce_sum(example_factors * losses)
  all_vars = [v for u in units for v in u.variables]
  grads = tape.gradient(weighted, keras_internals.gradient_sources(all_vars),
                        unconnected_gradients=_ZERO)
  return {id(v): _dense(g) for v, g in zip(all_vars, grads)}


def dense_result(model, result):
  """The clipped sums aligned with model.trainable_variables (zeros where absent).

  Args:
    model: the keras.Model; result: {id(variable): clipped sum}.

  Returns:
    a list of tensors, one per trainable variable (float32 for 16-bit variables).
  """
  return [result[id(v)] if id(v) in result else tf.zeros(v.shape, sum_dtype(v))
          for v in model.trainable_variables]
