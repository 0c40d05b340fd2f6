"""Private gradients in custom training loops (seed 002, Section 7), for the DP optimizers.

`CustomLoopMixin` is a base of `optimizers.DPOptimizerMixin`: `compute_private_gradients`
(the noised average of clipped per-record gradients) and `minimize` (one private step on a
vector of per-example losses). They use the optimizer's clipping (`clipped_sum`), noise and
ledger (`noised_average`): a custom loop writes the same ledger samples as `fit`. Declare the
sampling first with `optimizer.set_sampling(n, q, policy, sample_size)`; under policy
"shuffle" call `optimizer.ledger.record_passes(1)` whenever a pass over a new permutation
starts.
"""

import tensorflow as tf

from tf_dpiter.keras import gradients as grads_lib


class CustomLoopMixin:
  """compute_private_gradients / minimize on top of DPOptimizerMixin's private path."""


  def _records_and_masks(self, data, mask):
    b_static = grads_lib.static_batch_size(data)
    grads_lib.check_num_microbatches(self._dp_num_microbatches, b_static)
    b = grads_lib.dynamic_batch_size(data)
    example_mask = tf.ones([b], tf.float32) if mask is None else tf.cast(mask, tf.float32)
    return grads_lib.to_records(data, example_mask, self._dp_num_microbatches)

  def compute_private_gradients(self, loss_fn, variables, data=None, mask=None, tape=None):
    """Noised average of clipped per-record gradients, aligned with `variables`.

    Two forms. (a) data given: loss_fn(record_data) returns the losses of one record's
    examples (a vector [k], or a scalar mean), where record_data is `data` with leading
    axis k (k = 1 with num_microbatches=None); gradients are vectorized over records.
    (b) data None: loss_fn() (or, with `tape`, the tensor loss_fn) is the vector [B] of
    per-example losses; per-record gradients come from a batched jacobian.
    mask: float [B] of 0/1, padding rows 0.
    """
    variables = list(variables)
    m = self._dp_num_microbatches
    if data is not None:
      recs, em, rmask = self._records_and_masks(data, mask)

      def record_loss(rec):
        r_data, r_em = rec
        loss = tf.convert_to_tensor(loss_fn(r_data))
        if loss.shape.rank:
          loss = tf.reshape(loss, [-1])
          loss = tf.reduce_sum(loss * tf.cast(r_em, loss.dtype)) / tf.maximum(
              tf.cast(tf.reduce_sum(r_em), loss.dtype), 1.0)
        return loss, ()

      k = grads_lib.examples_per_record(m, grads_lib.static_batch_size(data), em)
      state, _, _ = self.clipped_sum(record_loss, variables, (recs, em), rmask, k)
      return self.noised_average(state, tf.reduce_sum(rmask))

    if tape is None:
      with tf.GradientTape(persistent=True) as tape:
        losses = self._vector_loss(loss_fn())
        rec_losses, rmask = self._record_losses(losses, mask)
    else:
      losses = self._vector_loss(loss_fn)
      with tape:
        rec_losses, rmask = self._record_losses(losses, mask)
    grads = grads_lib.jacobian_record_gradients(tape, rec_losses, variables)
    query = self._require_query()
    params = self._dp_params()
    state = query.initial_sample_state(
        [tf.TensorSpec(v.shape, tf.as_dtype(v.dtype)) for v in variables])
    state = self._accumulate(params, state, grads, rmask)
    return self.noised_average(state, tf.reduce_sum(rmask))

  @staticmethod
  def _vector_loss(loss):
    loss = tf.convert_to_tensor(loss)
    if loss.shape.rank == 0:
      raise ValueError(
          "a scalar loss was given where a vector of per-example losses [batch] is needed: "
          "compute the loss with reduction='none' (e.g. keras.losses.X(reduction=None))")
    return loss

  def _record_losses(self, losses, mask):
    b = tf.shape(losses)[0]
    losses = tf.reshape(losses, tf.stack([b, -1]))
    losses = tf.reduce_mean(losses, axis=1)
    grads_lib.check_num_microbatches(self._dp_num_microbatches, losses.shape[0])
    example_mask = tf.ones([b], losses.dtype) if mask is None else tf.cast(mask, losses.dtype)
    if self._dp_num_microbatches is None:
      return losses * example_mask, example_mask
    recs, em, rmask = grads_lib.to_records(losses, example_mask, self._dp_num_microbatches)
    em = tf.cast(em, losses.dtype)
    rec = tf.reduce_sum(recs * em, 1) / tf.maximum(tf.reduce_sum(em, 1), 1.0)
    return rec, rmask

  def minimize(self, loss, var_list, tape=None, mask=None):
    """One private step on a vector loss [B] (per-example losses).

    loss: a tensor computed under `tape`, or a callable returning it (tape made here).
    A scalar loss raises ValueError: per-example losses are needed for clipping.
    """
    var_list = list(var_list() if callable(var_list) and not isinstance(var_list, list)
                    else var_list)
    if callable(loss):
      grads = self.compute_private_gradients(loss, var_list, mask=mask)
    else:
      if tape is None:
        raise ValueError("minimize with a loss tensor needs the tape it was computed under "
                         "(tape=...), or pass a callable loss")
      grads = self.compute_private_gradients(loss, var_list, mask=mask, tape=tape)
    return self.apply_private_gradients(grads, var_list)
