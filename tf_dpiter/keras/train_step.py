"""The private train step of the DP models (seed 002, Sections 2 and 7; Abadi et al. 2016).

`TrainStepMixin` is a base of `models.DPModelMixin`. One step: per-record gradients of the
compiled loss, clipped to S and summed (vectorized path: `optimizer.clipped_sum`; fast path:
ghost norms, `fast_clipping.clipped_grad_sum`), one noise draw and one ledger sample
(`optimizer.noised_average`), then the optimizer's update. The path is chosen by
`optimizer.resolve_clipping` (routing.fast_path_obstacle).

With `jit_compile=True` the per-record gradients and clipping run under XLA; the noise, the
ledger write (growing buffers, no XLA) and the update run right after, in the same
non-compiled train function, so every step is recorded.
"""

import keras
import tensorflow as tf

from tf_dpiter.keras import batch_independence
from tf_dpiter.keras import chunking
from tf_dpiter.keras import fast_clipping
from tf_dpiter.keras import gradients as grads_lib
from tf_dpiter.keras import record_losses
from tf_dpiter.keras import routing


def _unpack(data):
  return keras.utils.unpack_x_y_sample_weight(data)


def _flat_records(t):
  """[R, k, ...] -> [R * k, ...] (record-major examples)."""
  return None if t is None else tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))


class TrainStepMixin:
  """make_train_function / train_step of a DP model (see module docstring)."""

  def make_train_function(self, force=False):  # pylint: disable=missing-function-docstring
    if self.train_function is not None and not force:
      return self.train_function
    jit = bool(self.jit_compile) and not self.run_eagerly
    opt = self._dp_optimizer()
    if opt.clipping != "vectorized" and self.built:
      batch_independence.probe_model(self)   # eagerly, cached (None: probed in the trace)
    if jit:
      # autograph=False: the step has no tensor-dependent Python control flow, and the
      # converted source would be re-read from disk at trace time.
      self._dp_core_fn = tf.function(self._dp_clipped_sum_step, jit_compile=True,
                                     reduce_retracing=True, autograph=False)
      self._jit_compile = False   # outer function (noise + ledger + update) without XLA
      try:
        super().make_train_function(force=True)
      finally:
        self._jit_compile = True
    else:
      self._dp_core_fn = self._dp_clipped_sum_step
      super().make_train_function(force=True)
    inner = self.train_function

    def guarded(iterator):
      # Set by StopAtPrivacyBudget: no step may start past the privacy budget.
      if getattr(self, "_dp_halt", False):
        raise StopIteration
      return inner(iterator)

    self.train_function = guarded
    return self.train_function

  def _dp_call(self, x):
    if self._call_has_training_arg:
      return self(x, training=True)
    return self(x)

  def _dp_inference(self, x):
    return self(x, training=False) if self._call_has_training_arg else self(x)

  def _dp_clipped_sum_step(self, x, y, sample_weight):
    """Per-record gradients, clipped and summed: (sample_state, loss sum, records, y_pred)."""
    opt = self._dp_optimizer()
    b_static = grads_lib.static_batch_size(x)
    b = grads_lib.dynamic_batch_size(x)
    m = opt.num_microbatches
    if not getattr(self, "_dp_in_fit", False):
      grads_lib.check_num_microbatches(m, b_static)
    example_mask = record_losses.example_mask_from_weights(sample_weight, b)
    variables = self.trainable_variables
    per_user = getattr(self, "_dp_examples_per_user", None)
    if per_user is not None:   # user-level batches: a record is one user's k rows
      recs, em, rmask = grads_lib.consecutive_records((x, y, sample_weight), example_mask,
                                                      per_user)
      k, m = per_user, None
    else:
      recs, em, rmask = grads_lib.to_records((x, y, sample_weight), example_mask, m)
      k = grads_lib.examples_per_record(m, b_static, em)
    if opt.resolve_clipping(self, input_specs=x) == "fast":
      state, loss_sum, records_out = self._dp_fast_sum(opt, recs, em, rmask, k, variables)
    else:
      state, loss_sum, records_out = self._dp_vectorized_sum(opt, recs, em, rmask, k, variables)
    if records_out is None:
      y_pred = self._dp_inference(x)
    else:
      y_pred = tf.nest.map_structure(lambda t: grads_lib.from_records(t, b, m), records_out)
    return state, loss_sum, tf.reduce_sum(rmask), y_pred

  def _dp_vectorized_sum(self, opt, recs, em, rmask, k, variables):
    """Clipped sum by the optimizer's vectorized path: (state, loss sum, outputs [M, k, ...])."""
    n_rep = tf.distribute.get_strategy().num_replicas_in_sync
    scale = routing.loss_scale(self)

    def record_loss(rec):
      (xr, yr, wr), emr = rec
      w = record_losses.record_weights(emr, wr)
      y_pred = self._dp_call(xr)
      loss = self._compute_loss(x=xr, y=yr, y_pred=y_pred, sample_weight=w, training=True)
      return tf.cast(loss, tf.float32) * (float(n_rep) * scale), y_pred

    return opt.clipped_sum(record_loss, variables, (recs, em), rmask, k,
                           vectorize=routing.use_vectorized_map(self), loss_scale=scale)

  def _dp_fast_sum(self, opt, recs, em, rmask, k, variables):
    """Clipped sum by fast_clipping (ghost norms): (state, loss sum, outputs [M, k, ...]).

    Records (examples or microbatches) are laid out record-major, k examples each, and
    clipped in physical chunks of whole records when max_physical_batch_size is set; the
    clipped sums of the chunks add up.
    """
    n_rep = float(tf.distribute.get_strategy().num_replicas_in_sync)

    scaled = routing.loss_scale(self) != 1.0   # fast_clipping applies the scale itself

    def chunk_fn(acc, chunk, chunk_rmask):
      c_recs, c_em = chunk
      xc, yc, _ = tf.nest.map_structure(_flat_records, c_recs)
      weights = record_losses.record_weights(c_em, c_recs[2])

      def regroup(t):  # [R * k, ...] -> [R, k, ...], the Keras mask too
        out = tf.reshape(t, tf.concat([tf.shape(c_em), tf.shape(t)[1:]], 0))
        mask = getattr(t, "_keras_mask", None)
        if mask is not None:
          out._keras_mask = tf.reshape(mask, tf.concat([tf.shape(c_em), tf.shape(mask)[1:]], 0))  # pylint: disable=protected-access
        return out

      def per_example_loss_fn(y_true, y_pred):
        # Every example of a record carries the record's loss: their masked mean is it.
        losses = record_losses.compiled_record_losses(
            self, tf.nest.map_structure(regroup, y_true), tf.nest.map_structure(regroup, y_pred),
            weights)
        return tf.repeat(losses * n_rep, k)

      grads, norms, outputs, losses = fast_clipping.clipped_grad_sum(
          self, xc, yc, per_example_loss_fn, opt.l2_norm_clip, mask=_flat_records(c_em),
          examples_per_record=k, return_outputs=True)
      # a record whose norm is not finite (float16 overflow) added nothing: count it
      with tf.control_dependencies(opt.count_overflowed(
          tf.math.is_finite(norms) if scaled else None, chunk_rmask)):
        grads = [tf.identity(g) for g in grads]
      losses = tf.reshape(tf.cast(losses, tf.float32), tf.shape(c_em))
      rec_loss = record_losses.masked_record_mean(losses, c_em)
      acc = [a + tf.cast(g, a.dtype) for a, g in zip(acc, grads)]
      return acc, tf.reduce_sum(rec_loss), tf.nest.map_structure(regroup, outputs)

    template = chunking.wide_template(variables)
    m_static = tf.TensorShape(rmask.shape)[0]
    per_chunk = chunking.records_per_chunk(opt.max_physical_batch_size, k, m_static)
    zeros = [tf.zeros(t.shape, t.dtype) for t in template]
    grad_sum, loss_sum, outputs = chunking.sum_over_chunks(chunk_fn, zeros, (recs, em), rmask,
                                                           per_chunk)
    if outputs is not None:
      outputs = tf.nest.map_structure(lambda t: t[:tf.shape(rmask)[0]], outputs)
    query = opt.dp_query
    state = query.initial_sample_state(template)
    state = query.accumulate_preprocessed_record(state, grad_sum)
    return state, loss_sum, outputs

  def train_step(self, data):  # pylint: disable=missing-function-docstring
    opt = self._dp_optimizer()
    x, y, sample_weight = _unpack(data)
    if not all(layer.built for layer in self._flatten_layers()):
      # Keras builds an unbuilt (e.g. subclassed) model on the first trace of the train
      # function; the per-record gradients need its variables first: one forward pass.
      self._dp_call(x)
    batch_independence.check_no_batch_mixing(self)
    core = getattr(self, "_dp_core_fn", None) or self._dp_clipped_sum_step
    state, loss_sum, num_records, y_pred = core(x, y, sample_weight)
    grads = opt.noised_average(state, num_records)
    opt.apply_private_gradients(grads, self.trainable_variables)
    self._loss_tracker.update_state(loss_sum / tf.maximum(num_records, 1.0),
                                    sample_weight=num_records)
    logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    if routing.loss_scale(self) != 1.0:
      logs = dict(logs)
      logs["dp_overflowed_records"] = opt.overflow_counter
    return logs
