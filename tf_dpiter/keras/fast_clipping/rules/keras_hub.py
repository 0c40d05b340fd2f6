"""Ghost norms of keras_hub layers, registered lazily: keras_hub is not a
dependency of tf_dpiter and is never imported here. `register_imported()`
(called by registry.lookup) registers a rule once the module defining its
class has been imported by the user.

keras_hub's ReversibleEmbedding is keras.layers.ReversibleEmbedding with the
same `call` (rules/reversible_embedding.py serves both). PositionEmbedding:

  PositionEmbedding (keras_hub.layers): out = broadcast_to(P[start:start+T], x.shape)
      (or P[positions] for explicit positions [T] or [B, T]); the output does
      not depend on x's values. With dz the gradient at the output, summed over
      any axes between the batch and the sequence axis, the per-example gradient
      of P puts dz_t on row start + t, so ||grad P_i||^2 = ||dz_i||^2 (raised to cover
      the rounding of a row's terms where a record has several: algebra.bias_sqr_norm); with
      explicit positions it is the lookup-table norm of rules/tables.py
      (repeated positions add up).
"""

import sys
import threading

import tensorflow as tf
from keras import ops

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping import registry
from tf_dpiter.keras.fast_clipping.rules import tables


def _summed_to_btd(dz):
  """[B, ..., T, D] -> [B, T, D] float32 (sum over the axes in between)."""
  dz = tf.cast(dz, tf.float32)
  rank = dz.shape.rank
  return tf.reduce_sum(dz, axis=list(range(1, rank - 2))) if rank > 3 else dz


@registry.float32_watched
@registry.supports_records
def position_embedding_norm_fn(layer, inputs, start_index=0, positions=None):
  """Norm function (registry contract) of keras_hub.layers.PositionEmbedding.

  Declines (vectorized path) a 2-d input (no sequence axis) and explicit
  positions on inputs of rank > 3.
  """
  rank = inputs.shape.rank
  if rank is None or rank < 3 or (positions is not None and rank != 3):
    return None
  shape = ops.shape(inputs)
  table = ops.convert_to_tensor(layer.position_embeddings)
  if positions is None:
    rows = ops.slice(table, (start_index, 0), (shape[-2], shape[-1]))
    ids = None
  else:
    ids = tf.convert_to_tensor(positions)
    ids = ids[None, :] if ids.shape.rank == 1 else ids
    rows = ops.take(table, ids, axis=0)
  outputs = ops.broadcast_to(rows, shape)

  def sqr_norm_fn(dz):
    if not algebra.trainable(layer.position_embeddings):
      return algebra.zeros(dz)
    if ids is None:
      # distinct rows: row t's gradient sum_m dz_{m,t} over the record's k examples and the
      # axes between the batch and the sequence axis, a bias of shape [T, D] broadcast onto
      # dz; the clipped sum is the tape's reduction of c dz, so the norm covers the rounding
      # of the record's terms (algebra.bias_sqr_norm; exact with one term per row)
      return algebra.bias_sqr_norm(dz, dz.shape[-2:])[0]
    d = _summed_to_btd(dz)
    flat = tf.broadcast_to(tf.cast(ids, tf.int32), tf.shape(d)[:2])
    return tables.same_id_sqr_norm(flat, d)

  return outputs, outputs, sqr_norm_fn


# module that defines the class -> {class name: norm function}
RULES = {
    "keras_hub.src.layers.modeling.position_embedding": {
        "PositionEmbedding": position_embedding_norm_fn,
    },
}

_LOCK = threading.Lock()
_DONE = set()


def register_imported():
  """Registers the rules of RULES whose module has been imported (each once).

  A rule registered by the user for the same class before this runs is
  replaced; register your own after the model is built and planned once, or
  call this function first.
  """
  if len(_DONE) == len(RULES):
    return
  with _LOCK:
    for module_name, rules in RULES.items():
      module = sys.modules.get(module_name)
      if module_name in _DONE or module is None:
        continue
      _DONE.add(module_name)
      for class_name, norm_fn in rules.items():
        registry.register_layer(getattr(module, class_name), norm_fn)


registry.add_lookup_hook(register_imported)
