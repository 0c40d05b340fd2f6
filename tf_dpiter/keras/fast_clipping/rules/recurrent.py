"""Ghost norms of SimpleRNN, LSTM and GRU; Bidirectional is covered
through its two sublayers.

The input kernel W and the recurrent kernel U are Dense-like maps applied at
every step t of the recurrence, so one example's gradients are

    grad W = sum_t x_t^T g_t,   grad U = sum_t a_t^T q_t,   grad b = sum_t g_t,

with g_t the gradient at the input projection x_t W + b_in of step t, a_t the
recurrent input (h_{t-1}; r_t * h_{t-1} for GRU's candidate kernel without
reset_after) and q_t the gradient at the recurrent projection (g_t itself for
SimpleRNN and LSTM, [g_z, g_r, r_t * g_h] for GRU with reset_after). The rule
re-runs Keras' recurrence (keras' own rnn loop, so masking, go_backwards,
zero_output_for_mask and unroll behave as in Keras) on the input projection
computed for all steps at once, which is the watched tensor: its gradient is
g. The loop also emits a_t (and r_t). The squared norms are factored norms
(algebra.factored_sqr_norm: Gram form sum_{t,s} <a_t, a_s><g_t, g_s> or the
per-example gradient, whichever is cheaper), and the clipped sum is
sum_i c_i sum_t a_t^T g_t (FactorSums: g weighted by the clip factors), everything in float32.
Both run over chunks of the batch whose temporaries take at most budget.CHUNK_BYTES
(rules/budget.py), one chunk at a time, so their memory does not grow with the batch.

Declines (the layer then takes the vectorized path): stateful layers, dropout
or recurrent dropout, LoRA/quantized cells, cells other than Keras' own.
"""

import keras
import tensorflow as tf
from keras import ops
from tf_dpiter.keras.internals import keras_internals as keras_backend  # .rnn: keras' RNN loop

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import budget

_CELLS = (keras.layers.SimpleRNNCell, keras.layers.LSTMCell, keras.layers.GRUCell)


def _accepts(layer):
  cell = layer.cell
  return (type(cell) in _CELLS and not layer.stateful and
          not getattr(cell, "dropout", 0) and not getattr(cell, "recurrent_dropout", 0)
          and algebra.plain_layer(cell))


def _biases(cell):
  """(input bias, recurrent bias) as used by the cell (either may be None)."""
  if not cell.use_bias:
    return None, None
  if isinstance(cell, keras.layers.GRUCell) and cell.reset_after:
    return cell.bias[0], cell.bias[1]
  return cell.bias, None


def _step_fn(cell, emit_prev):
  """Keras' cell math on the precomputed input projection xw_t: returns
  step(xw_t, states) -> (concat[h_t, a_t (, r_t)], new_states), without a_t = h_{t-1} when
  not emit_prev (without a mask it is the previous step's output, taken from the outputs:
  no second [T, B, units] sequence through the loop and its backward)."""
  emitted = lambda h, h_prev, *rest: ops.concatenate(
      [h] + ([h_prev] if emit_prev else []) + list(rest), -1)
  u = cell.recurrent_kernel
  units = cell.units
  _, rec_bias = _biases(cell)

  if isinstance(cell, keras.layers.SimpleRNNCell):
    def step(xw, states):
      h_prev = states[0]
      h = xw + ops.matmul(h_prev, u)
      h = cell.activation(h) if cell.activation is not None else h
      return emitted(h, h_prev), [h]
  elif isinstance(cell, keras.layers.LSTMCell):
    def step(xw, states):
      h_prev, c_prev = states
      z = ops.split(xw + ops.matmul(h_prev, u), 4, axis=-1)
      c, o = cell._compute_carry_and_output_fused(z, c_prev)  # pylint: disable=protected-access
      h = o * cell.activation(c)
      return emitted(h, h_prev), [h, c]
  else:
    def step(xw, states):
      h_prev = states[0]
      x_z, x_r, x_h = ops.split(xw, 3, axis=-1)
      if cell.reset_after:
        inner = ops.matmul(h_prev, u)
        if rec_bias is not None:
          inner = inner + rec_bias
      else:
        inner = ops.matmul(h_prev, u[:, :2 * units])
      z = cell.recurrent_activation(x_z + inner[:, :units])
      r = cell.recurrent_activation(x_r + inner[:, units:2 * units])
      if cell.reset_after:
        hh = cell.activation(x_h + r * inner[:, 2 * units:])
      else:
        hh = cell.activation(x_h + ops.matmul(r * h_prev, u[:, 2 * units:]))
      h = z * h_prev + (1 - z) * hh
      return emitted(h, h_prev, r), [h]
  return step


def _run(layer, sequences, initial_state, mask):
  """The layer's forward with the input projection as its own tensor:
  (outputs as layer.call returns them, xw [B, T, G], aux [B, T, *] in input
  time order, without gradient)."""
  cell = layer.cell
  in_bias, _ = _biases(cell)
  xw = ops.matmul(sequences, cell.kernel)
  if in_bias is not None:
    xw = xw + in_bias
  if initial_state is None:
    initial_state = layer.get_initial_state(batch_size=ops.shape(sequences)[0])
  if not isinstance(initial_state, (list, tuple)):
    initial_state = [initial_state]
  initial_state = [ops.convert_to_tensor(s, dtype=cell.compute_dtype)
                   for s in initial_state]
  if isinstance(mask, (list, tuple)):
    mask = mask[0]
  emit_prev = mask is not None   # with a mask, a_t is the state a masked step kept
  last, outs, states = keras_backend.rnn(
      _step_fn(cell, emit_prev), xw, initial_state, go_backwards=layer.go_backwards,
      mask=mask, unroll=layer.unroll, input_length=sequences.shape[1],
      zero_output_for_mask=layer.zero_output_for_mask, return_all_outputs=True)
  units = cell.units
  if emit_prev:
    aux = outs[:, :, units:]
  else:   # h_{t-1} in processing order: the initial state, then the outputs but the last
    h0 = ops.cast(initial_state[0], outs.dtype)[:, None]
    h_prev = tf.concat([h0, outs[:, :-1, :units]], 1)
    aux = h_prev if outs.shape[-1] == units else tf.concat([h_prev, outs[:, :, units:]], -1)
  aux = tf.stop_gradient(aux)
  if layer.go_backwards:
    aux = tf.reverse(aux, axis=[1])
  output = ops.cast(outs[:, :, :units] if layer.return_sequences else last[:, :units],
                    layer.compute_dtype)
  if layer.return_state:
    return (output, *[ops.cast(s, layer.compute_dtype) for s in states]), xw, aux
  return output, xw, aux


def _parts(cell, x, aux, g):
  """[(variable, [(a, b)] factor pairs, bias-like grads)] per trainable
  variable: grad v = sum over pairs of sum_t a_t^T b_t, or for a bias the list
  of per-example [B, T, n] gradients summed over t (stacked for GRU)."""
  units = cell.units
  h_prev = aux[:, :, :units]
  if isinstance(cell, keras.layers.GRUCell):
    r = aux[:, :, units:]
    g_z, g_r, g_h = g[:, :, :units], g[:, :, units:2 * units], g[:, :, 2 * units:]
    if cell.reset_after:
      q = tf.concat([g_z, g_r, r * g_h], -1)
      rec = [(h_prev, q)]
      bias = [g, q]
    else:
      rec = [(h_prev, g[:, :, :2 * units]), (r * h_prev, g_h)]
      bias = [g]
  else:
    rec, bias = [(h_prev, g)], [g]
  return [(cell.kernel, [(x, g)], None), (cell.recurrent_kernel, rec, None),
          (cell.bias, None, bias)]


def _sqr_norms(parts, rows):
  """Per-record squared norms of the trainable variables' gradients (`_parts`), upper bounds
  covering the rounding of the clipped sum's products over `rows` = B T rows (the whole
  batch's, also in a chunk)."""
  sq = None
  for v, pairs, bias in parts:
    if not algebra.trainable(v):
      continue
    if pairs is not None:   # several pairs: GRU without reset_after, U = [U_zr | U_h]
      terms = [algebra.factored_sqr_norm(a, b, sum_rows=rows)[0] for a, b in pairs]
    else:
      # sum_t b_t per record; the clipped sum adds c b over the batch's rows (_sums): the
      # bias's norm raised to cover its terms' rounding (1.06 C under XLA without)
      terms = [algebra.bias_sqr_norm(b, b.shape[-1:], rows)[0] for b in bias]
    for t in terms:
      sq = t if sq is None else sq + t
  return sq


def _sums(layer, parts_weighted):
  out = {}
  for v, pairs, bias in parts_weighted:
    if pairs is not None:
      blocks = [tf.einsum("btk,btn->kn", a, b) for a, b in pairs]
      out[id(v)] = blocks[0] if len(blocks) == 1 else tf.concat(blocks, axis=1)
    else:
      sums = [tf.reduce_sum(b, axis=[0, 1]) for b in bias]
      out[id(v)] = sums[0] if len(sums) == 1 else tf.stack(sums)
  return [out[id(v)] for v in layer.trainable_variables]


@registry.float32_sums
@registry.supports_records
def recurrent_norm_fn(layer, sequences, initial_state=None, mask=None, training=False):
  """Norm function (registry contract) of keras.layers.SimpleRNN, LSTM and GRU.

  Args:
    layer: the layer being called.
    sequences: [B, T, ...] input sequences.
    initial_state: the call's initial state (or None).
    mask: [B, T] mask (or None).
    training: the call's training flag.

  Returns:
    (outputs, watched, sqr_norm_fn) as in the registry module's contract, or None where
    this rule does not apply to the layer.
  """
  del training
  if not _accepts(layer):
    return None
  outputs, xw, aux = _run(layer, sequences, initial_state, mask)
  x = tf.stop_gradient(tf.cast(sequences, tf.float32))
  cell = layer.cell
  shapes = [v.shape for v in layer.trainable_variables]

  def sqr_norm_fn(dxw):
    g = tf.cast(dxw, tf.float32)
    m = _examples_per_chunk(x, aux, g)

    rows = algebra.batch_rows(g)   # the clipped sum's, not a chunk's

    def norms(xc, auxc, gc):
      return (_sqr_norms(_parts(cell, xc, tf.cast(auxc, tf.float32), gc), rows),)

    rec = m // algebra.current_examples_per_record() if m is not None else None
    sq = budget.over_chunks(norms, (x, aux, g), m, [tf.TensorSpec([rec], tf.float32)])[0]

    def weighted_sums(xc, auxc, gc, cc):
      # Rows of examples that add nothing (c = 0) are exactly zero in the weighted gradient;
      # their activations may be non-finite (float16 overflow): zeroed too.
      return _sums(layer, _parts(cell, algebra.finite_float32(xc), algebra.finite_float32(auxc),
                                 algebra.weight_rows(gc, cc)))

    def sum_fn(example_factors):
      c = tf.cast(example_factors, tf.float32)
      return budget.sum_over_chunks(weighted_sums, (x, aux, g, c), m, shapes)

    return registry.FactorSums(sq, sum_fn)

  return outputs, xw, sqr_norm_fn


def _examples_per_chunk(x, aux, g):
  """Examples per chunk of the norms and the clipped sum (rules/budget.py), or None (one call):
  per example the chunk's inputs, recurrent inputs and gradients, their copies (slices,
  weighted rows) and the [T, T] Gram matrices of up to three factor pairs."""
  dims = [algebra.static_dim(t, i) for t in (x, aux, g) for i in (1, 2)]
  k = algebra.current_examples_per_record()
  if None in dims or not isinstance(k, int):
    return None
  t = dims[0]
  widths = dims[1] + dims[3] + dims[5]
  return budget.examples_per_chunk(x, 4 * (3 * t * widths + 9 * k * t * t))
