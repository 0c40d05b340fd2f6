"""Private gradients in custom training loops (McMahan et al. 2018, Section 7), for the DP optimizers.

`CustomLoopMixin` is a base of `optimizers.DPOptimizerMixin`: `compute_private_gradients`
(the noised average of clipped per-record gradients) and `minimize` (one private step on a
vector of per-example losses). They use the optimizer's clipping (`clipped_sum`), noise and
ledger (`noised_average`): a custom loop writes the same ledger samples as `fit`. Declare the
sampling first with `optimizer.set_sampling(n, q, policy, sample_size)`; under policy
"shuffle" call `optimizer.ledger.record_passes(1)` whenever a pass over a new permutation
starts. Apply the result with `optimizer.apply_private_gradients` (plain `apply_gradients`
is refused).

The protections of `fit` apply here too, on every form (data or vector loss, callable or
tape, `minimize`), with or without `model=`:
* oneDNN guard: with `model=` given, a model with layers whose vectorized per-example
  gradients oneDNN gets wrong (routing.use_vectorized_map) gets its per-record gradients
  from a sequential loop (tf.map_fn, or a while-loop jacobian). Without `model=` the layers
  behind the variables are unknown, so on a oneDNN build (TensorFlow's default on many
  CPUs) every form uses the sequential loop: exact for every layer, slower (measured: the
  vectorized data form on MultiHeadAttention/EinsumDense aborted with `dnnl::error`). Pass
  `model=` to vectorize a model that has no affected layer;
* batch independence: the form with `data` runs each record alone (exact by construction);
  the form with a vector of losses computed on the whole batch is only exact if no layer
  mixes examples: with `model=` it is probed (batch_independence.probe_model) and refused if
  a layer mixes; without `model=` there is nothing to probe (the loss closes over the batch):
  pass `model=`, or use the data form;
* float16: under a float16 compute dtype (`mixed_float16`; read from `model`, else from the
  global Keras dtype policy) each record's loss is multiplied by a static loss scale and its
  float32 gradient divided by it; a record whose gradient overflowed adds zero (norm 0 <= C)
  and is counted in `optimizer.overflowed_records`, with a warning.
"""

import logging

import keras
import tensorflow as tf

from tf_dpiter.keras.model import batch_independence
from tf_dpiter.keras.optimizer import chunking
from tf_dpiter.keras.optimizer import gradients as grads_lib
from tf_dpiter.keras.optimizer import record_losses
from tf_dpiter.keras.optimizer import routing
from tf_dpiter.keras.optimizer import saved_ledger


_LOG = logging.getLogger("tf_dpiter")


def _loss_scale(model):
  return routing.loss_scale(model if model is not None else keras.config.dtype_policy())


def vectorize_records(model):
  """Whether per-record gradients may be vectorized (tf.vectorized_map / a pfor jacobian).

  With `model`: routing.use_vectorized_map(model) (False for oneDNN-affected layers, RNNs).
  Without: False on a oneDNN build, since an affected layer (EinsumDense, MultiHeadAttention)
  may be behind the variables and the sequential loop is exact for every layer; True else.

  Args:
    model: the keras.Model the loss runs, or None.
  Returns:
    bool.
  """
  if model is not None:
    return routing.use_vectorized_map(model)
  if routing.onednn_enabled():
    if not getattr(vectorize_records, "_told", False):
      vectorize_records._told = True   # once per process
      _LOG.warning(
          "tf_dpiter: compute_private_gradients without model= on a oneDNN build: per-record "
          "gradients come from a sequential loop (exact for every layer; oneDNN breaks the "
          "vectorized gradients of EinsumDense/MultiHeadAttention). Pass model=... to let "
          "models without such layers vectorize.")
    return False
  return True


class CustomLoopMixin:
  """compute_private_gradients / minimize on top of DPOptimizerMixin's private path."""

  def _records_and_masks(self, data, mask):
    b_static = grads_lib.static_batch_size(data)
    grads_lib.check_num_microbatches(self._dp_num_microbatches, b_static)
    b = grads_lib.dynamic_batch_size(data)
    example_mask = tf.ones([b], tf.float32) if mask is None else tf.cast(mask, tf.float32)
    return grads_lib.to_records(data, example_mask, self._dp_num_microbatches)

  def compute_private_gradients(self, loss_fn, variables, data=None, mask=None, tape=None,
                                model=None):
    """Noised average of clipped per-record gradients, aligned with `variables`.

    Two forms. (a) data given: loss_fn(record_data) returns the losses of one record's
    examples (a vector [k], or a scalar mean), where record_data is `data` with leading
    axis k (k = 1 with num_microbatches=None); gradients are vectorized over records, each
    record run alone. (b) data None: loss_fn() (or, with `tape`, the tensor loss_fn) is the
    vector [B] of per-example losses computed on the whole batch; per-record gradients come
    from a batched jacobian, exact only if no layer mixes examples.

    Args:
      loss_fn: see the two forms above.
      variables: the variables to differentiate (the result is aligned with them).
      data: a nest of [B, ...] tensors (form a), or None (form b).
      mask: float [B] of 0/1, padding rows 0.
      tape: the GradientTape the loss tensor was computed under (form b with a tensor).
      model: the keras.Model that loss_fn runs, for fit's protections (module docstring);
        without it, on a oneDNN build, per-record gradients come from a sequential loop.

    Returns:
      list of noised, averaged gradients (float32, or float64 for float64 variables); apply
      them with `apply_private_gradients`.

    Raises:
      ValueError: undeclared sampling, a scalar loss in form (b), more microbatches than
        examples, (form b with `model`) a layer that mixes the examples of a batch, or an
        optimizer whose iterations exceed its ledger's samples (restored without its
        ledger: `restore_ledger`).
    """
    saved_ledger.require_covers(self)   # a restored optimizer needs its ledger
    variables = list(variables)
    scale = _loss_scale(model)
    vectorize = vectorize_records(model)
    if data is not None:
      return self._private_gradients_of_records(loss_fn, variables, data, mask, scale, vectorize)
    self._check_batch_independent(model)
    if tape is None:
      with tf.GradientTape(persistent=True) as tape:
        losses = self._vector_loss(loss_fn())
        rec_losses, rmask = self._record_losses(losses, mask, scale)
    else:
      losses = self._vector_loss(loss_fn)
      with tape:
        rec_losses, rmask = self._record_losses(losses, mask, scale)
    grads = grads_lib.jacobian_record_gradients(tape, rec_losses, variables, use_pfor=vectorize)
    grads, finite = chunking.unscale_records(grads, scale)
    deps = self.count_overflowed(finite, rmask)
    query = self._require_query()
    params = self._dp_params()
    state = query.initial_sample_state(chunking.wide_template(variables))
    with tf.control_dependencies(deps):
      state = self._accumulate(params, state, grads, rmask)
    return self.noised_average(state, tf.reduce_sum(rmask))

  def _private_gradients_of_records(self, loss_fn, variables, data, mask, scale, vectorize):
    """Form (a) of compute_private_gradients: each record run alone through loss_fn."""
    recs, em, rmask = self._records_and_masks(data, mask)

    def record_loss(rec):
      r_data, r_em = rec
      loss = tf.convert_to_tensor(loss_fn(r_data))
      if loss.shape.rank:
        loss = record_losses.masked_record_mean(tf.reshape(loss, [-1]), r_em)
      return tf.cast(loss, tf.float32) * scale, ()

    k = grads_lib.examples_per_record(self._dp_num_microbatches,
                                      grads_lib.static_batch_size(data), em)
    state, _, _ = self.clipped_sum(record_loss, variables, (recs, em), rmask, k,
                                   vectorize=vectorize, loss_scale=scale)
    return self.noised_average(state, tf.reduce_sum(rmask))

  @staticmethod
  def _check_batch_independent(model):
    """Refuses form (b) on a model whose probe finds a layer that mixes examples."""
    if model is None:
      return
    mixing = batch_independence.probe_model(model)
    if mixing:
      raise ValueError(
          f"layers {list(mixing)} make one example's outputs depend on other examples of the "
          "batch, so per-example losses computed on the whole batch do not bound one "
          "example's influence. Pass the batch as data=... with a loss_fn of one record "
          "(each record is then run alone)")

  @staticmethod
  def _vector_loss(loss):
    loss = tf.convert_to_tensor(loss)
    if loss.shape.rank == 0:
      raise ValueError(
          "a scalar loss was given where a vector of per-example losses [batch] is needed: "
          "compute the loss with reduction='none' (e.g. keras.losses.X(reduction=None))")
    return loss

  def _record_losses(self, losses, mask, scale=1.0):
    b = tf.shape(losses)[0]
    losses = tf.reshape(tf.cast(losses, tf.float32), tf.stack([b, -1]))
    losses = tf.reduce_mean(losses, axis=1) * scale
    grads_lib.check_num_microbatches(self._dp_num_microbatches, losses.shape[0])
    example_mask = tf.ones([b], losses.dtype) if mask is None else tf.cast(mask, losses.dtype)
    if self._dp_num_microbatches is None:
      return losses * example_mask, example_mask
    recs, em, rmask = grads_lib.to_records(losses, example_mask, self._dp_num_microbatches)
    return record_losses.masked_record_mean(recs, em), rmask

  def minimize(self, loss, var_list, tape=None, mask=None, model=None):
    """One private step on a vector loss [B] (per-example losses).

    loss: a tensor computed under `tape`, or a callable returning it (tape made here).
    model: as in compute_private_gradients.
    A scalar loss raises ValueError: per-example losses are needed for clipping.
    """
    var_list = list(var_list() if callable(var_list) and not isinstance(var_list, list)
                    else var_list)
    if callable(loss):
      grads = self.compute_private_gradients(loss, var_list, mask=mask, model=model)
    else:
      if tape is None:
        raise ValueError("minimize with a loss tensor needs the tape it was computed under "
                         "(tape=...), or pass a callable loss")
      grads = self.compute_private_gradients(loss, var_list, mask=mask, tape=tape, model=model)
    return self.apply_private_gradients(grads, var_list)
