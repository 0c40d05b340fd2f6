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
sum_i c_i sum_t a_t^T g_t (GhostSums), everything in float32.

Declines (the layer then takes the vectorized path): stateful layers, dropout
or recurrent dropout, LoRA/quantized cells, cells other than Keras' own.
"""

import keras
import tensorflow as tf
from keras import ops
from tf_dpiter.keras.internals import keras_internals as keras_backend  # .rnn: keras' RNN loop

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry

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


def _step_fn(cell):
  """Keras' cell math on the precomputed input projection xw_t: returns
  step(xw_t, states) -> (concat[h_t, a_t (, r_t)], new_states)."""
  u = cell.recurrent_kernel
  units = cell.units
  _, rec_bias = _biases(cell)

  if isinstance(cell, keras.layers.SimpleRNNCell):
    def step(xw, states):
      h_prev = states[0]
      h = xw + ops.matmul(h_prev, u)
      h = cell.activation(h) if cell.activation is not None else h
      return ops.concatenate([h, h_prev], -1), [h]
  elif isinstance(cell, keras.layers.LSTMCell):
    def step(xw, states):
      h_prev, c_prev = states
      z = ops.split(xw + ops.matmul(h_prev, u), 4, axis=-1)
      c, o = cell._compute_carry_and_output_fused(z, c_prev)  # pylint: disable=protected-access
      h = o * cell.activation(c)
      return ops.concatenate([h, h_prev], -1), [h, c]
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
      return ops.concatenate([h, h_prev, r], -1), [h]
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
  last, outs, states = keras_backend.rnn(
      _step_fn(cell), xw, initial_state, go_backwards=layer.go_backwards,
      mask=mask, unroll=layer.unroll, input_length=sequences.shape[1],
      zero_output_for_mask=layer.zero_output_for_mask, return_all_outputs=True)
  units = cell.units
  aux = tf.stop_gradient(outs[:, :, units:])
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


def _sqr_norms(parts):
  sq = None
  for v, pairs, bias in parts:
    if not algebra.trainable(v):
      continue
    if pairs is not None:   # several pairs: GRU without reset_after, U = [U_zr | U_h]
      terms = [algebra.factored_sqr_norm(a, b)[0] for a, b in pairs]
    else:
      terms = [algebra.sqr_sum(registry.record_sum(tf.reduce_sum(b, axis=1)))
               for b in bias]
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

  def sqr_norm_fn(dxw):
    g = tf.cast(dxw, tf.float32)
    sq = _sqr_norms(_parts(cell, x, tf.cast(aux, tf.float32), g))

    def sum_fn(weighted):
      # Rows of examples that add nothing are zero in `weighted`; their
      # activations may be non-finite (float16 overflow): zeroed too.
      parts = _parts(cell, algebra.finite_float32(x), algebra.finite_float32(aux),
                     tf.cast(weighted, tf.float32))
      return _sums(layer, parts)

    return registry.GhostSums(sq, sum_fn)

  return outputs, xw, sqr_norm_fn
