"""DP versions of Keras 3 optimizers (seed 002, Section 7; DP-SGD of Abadi et al. 2016).

`make_dp_optimizer_class(keras.optimizers.X)` returns a subclass of X whose gradients are
private: per-record gradients are clipped to L2 norm S and summed by a DPQuery, the sum
gets Gaussian noise of standard deviation z*S once per logical batch, and the result is
divided by the batch's denominator (records in the batch; q*n, the expected batch size,
under Poisson sampling). The query is wrapped in `ledger.QueryWithLedger`, so every step
writes its sampling event and its sum query events to the optimizer's `ledger`.

The optimizer refuses plain gradients (`apply`/`apply_gradients` from outside the private
path): use a DP model (`DPSequential`, `make_private`), `compute_private_gradients`, or
`minimize` with a vector of per-example losses.

Microbatches (num_microbatches M): a record is a microbatch of k = ceil(B / M) examples, the
unit of privacy stays the example, and the ledger charges a clipped sum at sensitivity 2S
(one example changes inside a record that stays). They need replace-one sampling
("shuffle", "fixed_size"); see gradients.py for why. Custom training loops declare their
sampling with `set_sampling(n, q, policy, sample_size)` and, under "shuffle", call
`optimizer.ledger.record_passes(1)` whenever they start a pass over a new permutation (a
ledger with shuffled samples and no passes charges every sample as its own pass).
"""

import keras
import numpy as np
import tensorflow as tf

from tf_dpiter import dp_query as dp_query_lib
from tf_dpiter import ledger as ledger_lib
from tf_dpiter.keras import custom_loops
from tf_dpiter.keras import gradients as grads_lib
from tf_dpiter.keras import routing
from tf_dpiter.keras import settings

CLIPPING_MODES = settings.CLIPPING_MODES


def _wide(dtype):
  """float64 for float64, else float32: the dtype of the privacy arithmetic."""
  return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def wide_template(variables):
  """TensorSpecs of `variables` in the privacy arithmetic's dtype (float32 or float64)."""
  return [tf.TensorSpec(v.shape, _wide(v.dtype)) for v in variables]


def unscale_records(grads, scale):
  """Per-record gradients [M, ...] divided by the loss scale (in float32); a record whose
  gradient is not finite (float16 overflow) becomes zero, a function of that record alone."""
  if scale == 1.0:
    return grads
  grads = [tf.cast(g, _wide(g.dtype)) / scale for g in grads]
  finite = None
  for g in grads:
    ok = tf.reduce_all(tf.reshape(tf.math.is_finite(g), [tf.shape(g)[0], -1]), axis=1)
    finite = ok if finite is None else tf.logical_and(finite, ok)
  return [tf.where(tf.reshape(finite, [-1] + [1] * (len(g.shape) - 1)), g, tf.zeros_like(g))
          for g in grads]


def _load_fast_clipping():
  """The fast (ghost-norm) clipping module, or None if it cannot be imported."""
  try:
    from tf_dpiter.keras import fast_clipping  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  if not (hasattr(fast_clipping, "clipped_grad_sum") and hasattr(fast_clipping, "supports")):
    return None
  return fast_clipping


class DPOptimizerMixin(custom_loops.CustomLoopMixin):
  """Private-gradient logic shared by every DP optimizer class (see module docstring)."""

  def __init__(self, l2_norm_clip=None, noise_multiplier=None, num_microbatches=None, *args,
               dp_query=None, max_physical_batch_size=None, clipping="auto", normalize=True,
               seed=None, ledger_journal=None, secure_mode=False, **kwargs):
    """l2_norm_clip S (L2 norm, loss-gradient units), noise_multiplier z (noise stddev z*S on
    the sum), num_microbatches M (None: one example per record), dp_query (instead of S, z:
    any DPQuery whose result is a sum over records), max_physical_batch_size P (examples per
    physical chunk; noise still once per logical batch), clipping "auto"|"vectorized"|"fast",
    normalize (divide the noised sum by the denominator), seed (tests only: not private),
    ledger_journal (path of a ledger journal that DPModel.fit resumes and appends: crash
    safety for ModelCheckpoint-style restarts; saved in the config, so a model loaded from a
    checkpoint resumes it), secure_mode (the default GaussianSumQuery draws its noise from
    os.urandom as a sum of two draws: dp_query.randomness.SecureRandom; no seed)."""
    settings.check_args(l2_norm_clip, noise_multiplier, num_microbatches, dp_query,
                        max_physical_batch_size, clipping)
    if ledger_journal is not None and (not isinstance(ledger_journal, str) or not ledger_journal):
      raise ValueError(f"ledger_journal must be None or a file path, got {ledger_journal!r}")
    super().__init__(*args, **kwargs)
    self._dp_ledger_journal = ledger_journal
    self._dp_l2_norm_clip = None if l2_norm_clip is None else float(l2_norm_clip)
    self._dp_noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
    self._dp_num_microbatches = num_microbatches
    self._dp_max_physical_batch_size = max_physical_batch_size
    self._dp_clipping = clipping
    self._dp_normalize = bool(normalize)
    self._dp_seed = seed
    if secure_mode and (dp_query is not None or seed is not None):
      raise ValueError("secure_mode applies to the default query and takes no seed; got "
                       f"dp_query={dp_query!r}, seed={seed!r}")
    self._dp_secure_mode = bool(secure_mode)
    self._dp_custom_query = dp_query is not None
    # The default query, the ledger and the sampling variables are made lazily, outside
    # any tf.distribute scope (see _make_dp_state): the ledger's growing buffers cannot be
    # mirrored variables, and the noise must come from one generator.
    self._dp_base_query = dp_query
    self._dp_ledger = None
    self._dp_expected_records = None
    self._dp_query = None         # QueryWithLedger, made by set_sampling
    self._dp_global_vars = None
    self._dp_restored_global_state = None  # from from_config: the saved query state
    self._dp_private_apply = False
    self._dp_sampling_source = None  # "user" (set_sampling) or "fit" (declared by fit)

  # ---- properties ---------------------------------------------------------------------

  @property
  def l2_norm_clip(self):
    return self._dp_l2_norm_clip

  @property
  def noise_multiplier(self):
    return self._dp_noise_multiplier

  @property
  def num_microbatches(self):
    return self._dp_num_microbatches

  @property
  def max_physical_batch_size(self):
    return self._dp_max_physical_batch_size

  @property
  def ledger_journal(self):
    """Path of the ledger journal DPModel.fit keeps (None: none unless fit is given one)."""
    return self._dp_ledger_journal

  @property
  def clipping(self):
    return self._dp_clipping

  @property
  def dp_query(self):
    """The QueryWithLedger in use (None until the sampling is known)."""
    return self._dp_query

  @property
  def ledger(self):
    """The PrivacyLedger every private step writes to."""
    self._make_dp_state()
    return self._dp_ledger

  def _make_dp_state(self):
    if self._dp_ledger is not None:
      return
    if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
      raise ValueError(
          "the DP state (ledger, noise generator) must be created outside a tf.distribute "
          "scope: call model.fit / optimizer.set_sampling outside `with strategy.scope():` "
          "(build and compile the model inside it as usual)")
    with tf.init_scope():
      if self._dp_base_query is None:
        stddev = 0.0 if self._dp_noise_multiplier == 0 else (
            self._dp_noise_multiplier * self._dp_l2_norm_clip)
        self._dp_base_query = dp_query_lib.GaussianSumQuery(
            self._dp_l2_norm_clip, stddev, seed=self._dp_seed, secure_mode=self._dp_secure_mode)
      self._dp_expected_records = tf.Variable(1.0, dtype=tf.float32, trainable=False,
                                              name="dp_expected_records")
      self._dp_ledger = ledger_lib.PrivacyLedger()

  @property
  def sampling_policy(self):
    return None if self._dp_query is None else self._dp_query.policy

  # ---- sampling -----------------------------------------------------------------------

  def set_sampling(self, population_size, selection_probability, policy="poisson",
                   sample_size=0):
    """Declares how batches are sampled; the ledger records it with every step.

    With num_microbatches M a record is a microbatch of k = ceil(sample_size / M) examples
    (`examples_per_record`); the ledger then charges a clipped sum at sensitivity 2S
    (seed 002, Table 1 and Appendix A). Microbatches need a policy whose positions come
    from a public permutation with n fixed (replace-one: "shuffle", "fixed_size"): under
    add/remove (Poisson, full batches) removing an example would re-deal the later
    examples among the microbatches (gradients.to_records).

    Args:
      population_size: n, records in the data set.
      selection_probability: q (sample_size / n for shuffle and fixed_size).
      policy: one of ledger.POLICIES.
      sample_size: batch size (expected batch size for Poisson); required (>= 1) for
        "shuffle" and "fixed_size".

    Returns:
      True when the recorded policy or record unit changed (a traced step must be retraced).

    Raises:
      ValueError: num_microbatches with policy "poisson" or "full", or a bad argument.
    """
    m = self._dp_num_microbatches
    if m is not None and ledger_lib.relation_for_policy(policy) == ledger_lib.ADD_OR_REMOVE:
      raise ValueError(
          f"num_microbatches={m} cannot be used with policy {policy!r}: under add or remove "
          "one example, removing an example re-deals the others among microbatches. Sample "
          "with shuffled passes (model.fit(..., sampling=\"shuffle\") or "
          "dp.data.shuffled_batches), or use num_microbatches=None")
    k = 1 if m is None else max(1, -(-int(sample_size) // m))
    self._make_dp_state()
    with tf.init_scope():
      if self._dp_query is None or self._dp_query.policy != policy:
        self._dp_query = ledger_lib.QueryWithLedger(
            self._dp_base_query, population_size, selection_probability, ledger=self._dp_ledger,
            policy=policy, sample_size=sample_size, examples_per_record=k)
        changed = True
      else:
        changed = self._dp_query.examples_per_record != k
        self._dp_query.set_sampling(population_size, selection_probability, sample_size,
                                    examples_per_record=k)
      if self._dp_global_vars is None:
        init = tf.nest.map_structure(tf.convert_to_tensor, self._dp_query.initial_global_state())
        self._dp_global_struct = init
        flat = self._restore_global_state(tf.nest.flatten(init))
        self._dp_global_vars = [tf.Variable(t, trainable=False, name="dp_global_state")
                                for t in flat]
      self._dp_expected_records.assign(float(population_size) * float(selection_probability))
    # A call from user code declares data that fit cannot see (DPModel.fit overrides this).
    self._dp_sampling_source = "user"
    return changed

  def _restore_global_state(self, flat_init):
    """The saved query state (e.g. an adaptive clip) in place of the initial one, if any."""
    saved = self._dp_restored_global_state
    if saved is None:
      return flat_init
    if not isinstance(saved, (list, tuple)) or len(saved) != len(flat_init) or any(
        tuple(np.shape(s)) != tuple(t.shape) for s, t in zip(saved, flat_init)):
      raise ValueError(
          "the saved dp_global_state does not match the query's state (expected "
          f"{len(flat_init)} values of shapes {[tuple(t.shape) for t in flat_init]}), got "
          f"{saved!r}")
    self._dp_restored_global_state = None
    return [tf.constant(np.asarray(s), dtype=t.dtype) for s, t in zip(saved, flat_init)]

  def _require_query(self):
    if self._dp_query is None:
      raise ValueError(
          "the sampling policy is unknown, so the ledger cannot record this step: train with "
          "model.fit on arrays or on dp.data.poisson_batches/shuffled_batches, or call "
          "optimizer.set_sampling(population_size, selection_probability, policy, sample_size) first")
    return self._dp_query

  def _dp_global_state(self):
    return tf.nest.pack_sequence_as(self._dp_global_struct,
                                    [v.read_value() for v in self._dp_global_vars])

  def _dp_params(self):
    query = self._require_query()
    return query.derive_sample_params(self._dp_global_state())

  # ---- clipping -----------------------------------------------------------------------

  def resolve_clipping(self, model=None, input_specs=None):
    """'vectorized' or 'fast': which per-example clipping a step uses.

    "auto" takes the fast (ghost-norm) path only when `routing.fast_path_obstacle` finds
    nothing in the way: among others, a batch-independence probe (run once per model,
    cached; see batch_independence) must see no layer that mixes examples, and no trainable
    layer may compute in 16 bits. Otherwise "auto" takes the vectorized path, which is exact
    for such models (each record is run and clipped alone, in float32).

    Args:
      model: the keras.Model the step trains.
      input_specs: optional nest of tensors/specs shaped like a batch (for the probe of a
        model without known inputs).

    Returns:
      "vectorized" or "fast".

    Raises:
      ValueError: clipping="fast" and the fast path cannot clip this model exactly (the
        message names the offending layer, dtype policy or setting).
    """
    if self._dp_clipping == "vectorized":
      return "vectorized"
    reason = routing.fast_path_obstacle(self, model, _load_fast_clipping(), input_specs)
    if reason is None:
      return "fast"
    if self._dp_clipping == "fast":
      raise ValueError(
          f"clipping='fast' cannot clip this model exactly: {reason}. Use clipping='auto' or "
          "'vectorized' (each record is clipped alone, exact for it)")
    return "vectorized"

  def _accumulate(self, params, sample_state, grads, record_mask):
    query = self._require_query()
    grads = [tf.cast(g, _wide(g.dtype)) for g in grads]
    if hasattr(query, "accumulate_records"):
      return query.accumulate_records(params, sample_state, grads, mask=record_mask)
    pre = tf.vectorized_map(lambda r: query.preprocess_record(params, r), grads)
    summed = tf.nest.map_structure(
        lambda t: tf.reduce_sum(t * tf.reshape(tf.cast(record_mask, t.dtype),
                                               [-1] + [1] * (len(t.shape) - 1)), 0), pre)
    return query.accumulate_preprocessed_record(sample_state, summed)

  def clipped_sum(self, record_loss_fn, variables, records, record_mask, examples_per_record=1,
                  vectorize=True, loss_scale=1.0):
    """Sample state (clipped sum) over records, vectorized, in physical chunks.

    record_loss_fn(record) -> (scalar loss, aux). records: nest of [M, ...] tensors;
    record_mask [M] (0: padding record). The per-record gradients are cast to float32
    (float64 for float64 variables) before the norms, the clip factors and the sum, whatever
    the dtype policy; with loss_scale s != 1 (float16), record_loss_fn's loss is s times the
    record's loss and the gradients are divided by s (`unscale_records`). Returns
    (sample_state, sum of record losses over real records, aux stacked [M, ...], or None
    with a dynamic number of chunks).
    """
    query = self._require_query()
    loss_scale = float(loss_scale)

    def gradients(rec):
      grads, losses, aux = grads_lib.per_record_gradients(record_loss_fn, variables, rec, vectorize)
      return unscale_records(grads, loss_scale), losses / loss_scale, aux

    variables = list(variables)
    params = self._dp_params()
    template = wide_template(variables)
    state = query.initial_sample_state(template)
    record_mask = tf.cast(record_mask, tf.float32)
    p = self._dp_max_physical_batch_size
    m_static = tf.TensorShape(record_mask.shape)[0]
    if p is not None:
      per_chunk = max(1, p // int(examples_per_record)) if isinstance(
          examples_per_record, int) else tf.maximum(1, p // examples_per_record)
    if p is None or (m_static is not None and isinstance(per_chunk, int) and per_chunk >= m_static):
      grads, losses, aux = gradients(records)
      state = self._accumulate(params, state, grads, record_mask)
      return state, tf.reduce_sum(losses * record_mask), aux

    chunks, cmask, nchunks = grads_lib.chunked(records, record_mask, per_chunk)
    static_chunks = tf.get_static_value(nchunks)
    loss_sum = tf.constant(0.0)
    if static_chunks is not None:
      # Static shapes (XLA included): unrolled loop over the physical chunks.
      auxes = []
      for i in range(int(static_chunks)):
        rec = tf.nest.map_structure(lambda t: None if t is None else t[i], chunks)
        grads, losses, aux = gradients(rec)
        state = self._accumulate(params, state, grads, cmask[i])
        loss_sum = loss_sum + tf.reduce_sum(losses * cmask[i])
        auxes.append(aux)
      aux = tf.nest.map_structure(lambda *ts: tf.concat(ts, 0)[:m_static], *auxes)
      return state, loss_sum, aux

    def body(i, st, loss_acc):
      rec = tf.nest.map_structure(lambda t: None if t is None else t[i], chunks)
      grads, losses, _ = gradients(rec)
      st = self._accumulate(params, st, grads, cmask[i])
      return i + 1, st, loss_acc + tf.reduce_sum(losses * cmask[i])

    _, state, loss_sum = tf.while_loop(lambda i, *_: i < nchunks, body,
                                       [tf.constant(0), state, loss_sum])
    return state, loss_sum, None  # aux not kept with a dynamic number of chunks

  # ---- noise, ledger, update ----------------------------------------------------------

  def _noise_and_record(self, sample_state):
    query = self._require_query()
    global_state = self._dp_global_state()
    result, new_state, _ = query.get_noised_result(sample_state, global_state)
    assigns = [v.assign(t) for v, t in zip(self._dp_global_vars, tf.nest.flatten(new_state))]
    with tf.control_dependencies(assigns):
      return tf.nest.map_structure(tf.identity, result)

  def noised_average(self, sample_state, num_records):
    """Noised sum / denominator: one noise draw and one ledger sample per logical batch.

    Under a tf.distribute strategy the replicas' clipped sums are all-reduced first and the
    noise is drawn once, in cross-replica context. num_records: records in this replica's
    batch (the denominator, unless Poisson sampling, where it is q*n).
    """
    self._require_query()
    num_records = tf.cast(num_records, tf.float32)
    ctx = tf.distribute.get_replica_context()
    n_rep = tf.distribute.get_strategy().num_replicas_in_sync
    if ctx is not None and n_rep > 1:
      sample_state = ctx.all_reduce(tf.distribute.ReduceOp.SUM, sample_state)
      num_records = ctx.all_reduce(tf.distribute.ReduceOp.SUM, num_records)

      def merge_fn(strategy, state):
        local = tf.nest.map_structure(lambda t: strategy.experimental_local_results(t)[0], state)
        return self._noise_and_record(local)

      result = ctx.merge_call(merge_fn, args=(sample_state,))
    else:
      result = self._noise_and_record(sample_state)
    if not self._dp_normalize:
      denom = tf.constant(1.0)
    elif self._dp_query.policy == ledger_lib.POISSON:
      denom = self._dp_expected_records.read_value()
    else:
      denom = tf.maximum(num_records, 1.0)
    # Keras sums gradients over replicas in apply(): pre-divide by the replica count.
    denom = denom * float(n_rep)
    return [tf.cast(r / tf.cast(denom, r.dtype), r.dtype) for r in tf.nest.flatten(result)]

  def apply_private_gradients(self, grads, trainable_variables):
    """Applies gradients that came out of `noised_average`."""
    self._dp_private_apply = True
    grads = [g if g is None else tf.cast(g, v.dtype) for g, v in zip(grads, trainable_variables)]
    try:
      return super().apply(grads, trainable_variables)
    finally:
      self._dp_private_apply = False

  def apply(self, grads, trainable_variables=None):  # pylint: disable=missing-function-docstring
    if not self._dp_private_apply:
      raise ValueError(
          f"{type(self).__name__} received plain (non-private) gradients. Train a DP model "
          "(dp.keras.DPSequential / dp.keras.make_private), or use "
          "optimizer.compute_private_gradients / optimizer.minimize with per-example losses")
    return super().apply(grads, trainable_variables)

  # ---- serialization ------------------------------------------------------------------

  def get_config(self):
    """Keras config; a custom dp_query is stored as tf_dpiter.dp_query.serialize(query).

    With a custom dp_query, "dp_global_state" (once training started) holds the query's
    current global state (e.g. the adaptive clip of QuantileAdaptiveClipSumQuery) as plain
    values: from_config resumes from it, as the learning rate resumes from its current
    value. Delete that key to start from the query's initial state. The ledger is not part
    of the config (save it with ledger.save_json); a seeded query's noise restarts its stream.
    """
    config = super().get_config()
    config.update({
        "l2_norm_clip": self._dp_l2_norm_clip,
        "noise_multiplier": self._dp_noise_multiplier,
        "num_microbatches": self._dp_num_microbatches,
        "max_physical_batch_size": self._dp_max_physical_batch_size,
        "clipping": self._dp_clipping,
        "normalize": self._dp_normalize,
        "seed": self._dp_seed,
        "ledger_journal": self._dp_ledger_journal,
        "secure_mode": self._dp_secure_mode,
    })
    if self._dp_custom_query:
      # The default query's state is fixed by (S, z); a custom one's may adapt.
      config["dp_query"] = dp_query_lib.serialize(self._dp_base_query)
      if self._dp_global_vars is not None:
        config["dp_global_state"] = [np.asarray(v.numpy()).tolist()
                                     for v in self._dp_global_vars]
      elif self._dp_restored_global_state is not None:
        config["dp_global_state"] = self._dp_restored_global_state
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    """Inverse of get_config (a serialized dp_query is rebuilt; the query state resumed)."""
    config = dict(config)
    if isinstance(config.get("dp_query"), dict):
      config["dp_query"] = dp_query_lib.deserialize(config["dp_query"], custom_objects)
    state = config.pop("dp_global_state", None)
    opt = super().from_config(config, custom_objects=custom_objects)
    opt._dp_restored_global_state = state  # pylint: disable=protected-access
    return opt


_CLASS_CACHE = {}
_READY_NAMES = {"SGD": "DPKerasSGDOptimizer", "Adam": "DPKerasAdamOptimizer",
                "Adagrad": "DPKerasAdagradOptimizer", "RMSprop": "DPKerasRMSpropOptimizer",
                "AdamW": "DPKerasAdamWOptimizer"}


def make_dp_optimizer_class(cls):
  """DP subclass of any keras.optimizers.Optimizer subclass (a user's own too).

  The new class takes (l2_norm_clip, noise_multiplier, num_microbatches=None, *,
  dp_query=None, max_physical_batch_size=None, clipping="auto", normalize=True, seed=None,
  ledger_journal=None, secure_mode=False)
  before the base class' own arguments, and is registered for Keras serialization.
  """
  if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
    raise ValueError(f"cls must be a keras.optimizers.Optimizer subclass, got {cls!r}")
  if issubclass(cls, DPOptimizerMixin):
    return cls
  if cls in _CLASS_CACHE:
    return _CLASS_CACHE[cls]
  name = _READY_NAMES.get(cls.__name__) if cls.__module__.startswith("keras") else None
  name = name or f"DP{cls.__name__}"
  new_cls = type(name, (DPOptimizerMixin, cls), {
      "__doc__": f"DP version of {cls.__module__}.{cls.__qualname__} (see DPOptimizerMixin).",
      "__module__": __name__,
  })
  new_cls = keras.saving.register_keras_serializable(package="tf_dpiter", name=name)(new_cls)
  _CLASS_CACHE[cls] = new_cls
  return new_cls


def DPOptimizer(optimizer, l2_norm_clip=None, noise_multiplier=None, num_microbatches=None,  # pylint: disable=invalid-name
                dp_query=None, max_physical_batch_size=None, clipping="auto", normalize=True,
                seed=None, ledger_journal=None, secure_mode=False):
  """DP copy of a Keras optimizer instance (same hyperparameters; fresh state).

  Either (l2_norm_clip, noise_multiplier) or dp_query (a sum query, e.g. a NestedQuery
  over the trainable variables' list) must be given.
  """
  if not isinstance(optimizer, keras.optimizers.Optimizer):
    raise ValueError(f"optimizer must be a keras.optimizers.Optimizer instance, got {optimizer!r}")
  if isinstance(optimizer, DPOptimizerMixin):
    raise ValueError(f"optimizer is already a DP optimizer ({type(optimizer).__name__})")
  cls = make_dp_optimizer_class(type(optimizer))
  config = dict(optimizer.get_config())
  lr = config.get("learning_rate")
  if isinstance(lr, dict):
    config["learning_rate"] = keras.optimizers.schedules.deserialize(lr)
  return cls(l2_norm_clip, noise_multiplier, num_microbatches, dp_query=dp_query,
             max_physical_batch_size=max_physical_batch_size, clipping=clipping,
             normalize=normalize, seed=seed, ledger_journal=ledger_journal,
             secure_mode=secure_mode, **config)


DPKerasSGDOptimizer = make_dp_optimizer_class(keras.optimizers.SGD)
DPKerasAdamOptimizer = make_dp_optimizer_class(keras.optimizers.Adam)
DPKerasAdagradOptimizer = make_dp_optimizer_class(keras.optimizers.Adagrad)
DPKerasRMSpropOptimizer = make_dp_optimizer_class(keras.optimizers.RMSprop)
DPKerasAdamWOptimizer = make_dp_optimizer_class(keras.optimizers.AdamW)
