"""The DP optimizers' mechanism state: query, ledger, sampling and noise (McMahan et al. 2018, Secs. 2-5).

`MechanismMixin` is a base of `optimizers.DPOptimizerMixin`. It owns the DPQuery (the Gaussian
sum query of clip S and noise stddev z*S, or a user's query) wrapped in
`ledger.QueryWithLedger`, the sampling declaration the ledger records with every step
(`set_sampling`), and `noised_average`: one noise draw and one ledger sample per logical
batch, then division by the batch's denominator (records in the batch; the public expected size q*n under Poisson and truncated
Poisson, q*n/b under cyclic Poisson: `expected_records`).
"""

import contextlib
import sys

import numpy as np
import tensorflow as tf

from tf_dpiter import dp_query as dp_query_lib
from tf_dpiter import ledger as ledger_lib
from tf_dpiter.ledger import records

# Policies whose batch size is random: the noised sum is divided by its public expected size
# (the realized size is not protected by the noise under add/remove one example).
EXPECTED_SIZE_POLICIES = (ledger_lib.POISSON, records.USER_POISSON, records.CYCLIC_POISSON,
                          records.TRUNCATED_POISSON)


def expected_records(policy, population_size, selection_probability, sample_size):
  """The public expected batch size of a sample: q n, or q n / b under cyclic_poisson (one of
  its b = sample_size groups is sampled per step); truncated_poisson: q n, the mean before the
  cap (any public constant keeps the guarantee).

  Args:
    policy: the sampling policy (ledger.POLICIES); population_size: n;
    selection_probability: q; sample_size: b (groups under cyclic_poisson).
  Returns:
    the expected number of records, a float.
  """
  expected = float(population_size) * float(selection_probability)
  if policy == records.CYCLIC_POISSON:
    expected /= float(sample_size)
  return expected


class MechanismMixin:
  """Query, ledger, sampling and noise of a DP optimizer (see module docstring)."""

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
        self._dp_base_query = dp_query_lib.GaussianSumQuery.from_noise_multiplier(
            self._dp_l2_norm_clip, self._dp_noise_multiplier, seed=self._dp_seed,
            secure_mode=self._dp_secure_mode)
      self._dp_expected_records = tf.Variable(1.0, dtype=tf.float32, trainable=False,
                                              name="dp_expected_records")
      self._dp_ledger = ledger_lib.PrivacyLedger()
      self._dp_overflow_count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="dp_overflowed_records")

  @property
  def noise_generator(self):
    """The noise source of the optimizer's query (`GaussianSumQuery.noise_generator`).

    Raises:
      ValueError: a custom `dp_query` that does not expose `noise_generator`.
    """
    self._make_dp_state()
    generator = getattr(self._dp_base_query, "noise_generator", None)
    if generator is None:
      raise ValueError(
          f"dp_query={self._dp_base_query!r} does not expose `noise_generator`: its noise "
          "cannot be synchronized across workers")
    return generator

  @property
  def overflowed_records(self):
    """Records whose float16 gradient overflowed (non-finite) and were zeroed, since the
    optimizer was made (mixed_float16 only; see chunking.unscale_records). A zeroed record
    adds 0 to the clipped sum (norm 0 <= C): the guarantee holds, but its data was not used."""
    self._make_dp_state()
    return int(self._dp_overflow_count.numpy())

  @property
  def overflow_counter(self):
    """The int64 tf.Variable behind `overflowed_records` (readable inside a tf.function)."""
    self._make_dp_state()
    return self._dp_overflow_count

  def count_overflowed(self, finite, record_mask):
    """Adds the real records (record_mask > 0) whose gradient was zeroed (finite False) to
    `overflowed_records`, printing a warning when there are any. finite None: no loss scale.
    Called by both clipping paths and the custom loops.

    Args:
      finite: [R] bool, whether each record's gradient was finite (None: no loss scale).
      record_mask: [R] 0/1, the real records.
    Returns:
      a list of control dependencies for the accumulation.
    """
    if finite is None:
      return []
    zeroed = tf.logical_and(tf.logical_not(finite), tf.cast(record_mask, tf.float32) > 0)
    count = tf.reduce_sum(tf.cast(zeroed, tf.int64))

    def warn():
      tf.print("WARNING: tf_dpiter: the float16 gradients of", count, "record(s) overflowed "
               "and were zeroed (they add 0 to the clipped sum; the privacy guarantee holds). "
               "Lower the learning rate or train under mixed_bfloat16/float32; "
               "optimizer.overflowed_records counts them.", output_stream=sys.stderr)
      return tf.constant(True)

    self._make_dp_state()
    added = self._dp_overflow_count.assign_add(count)
    with tf.control_dependencies([added]):
      return [tf.cond(count > 0, warn, lambda: tf.constant(False))]

  @property
  def sampling_policy(self):
    """The sampling policy the ledger records (ledger.POLICIES), None before set_sampling."""
    return None if self._dp_query is None else self._dp_query.policy

  @property
  def uses_custom_query(self):
    """True when the optimizer was built with a user's `dp_query` (not from S and z)."""
    return bool(self._dp_custom_query)

  @property
  def sampling_source(self):
    """Who declared the sampling: "user" (a set_sampling call), "fit" (DPModel.fit declared
    its own data) or None (not declared yet)."""
    return self._dp_sampling_source

  def mark_sampling_from_fit(self):
    """Records that DPModel.fit, not the user, declared the current sampling (so the next
    fit may declare its own data again)."""
    self._dp_sampling_source = "fit"

  @property
  def clips_by_factors(self):
    """True if the query's clipping is a factor of the record's L2 norm that it can give for
    norms computed elsewhere (`dp_query.gives_clip_factors`): the fast path needs it."""
    base = self._dp_base_query
    return base is None or dp_query_lib.gives_clip_factors(base)   # None: the Gaussian default

  def record_clip_factors_fn(self):
    """norms -> clip factors of this sample, by the query's own rule.

    `DPQuery.record_clip_factors(params, norms)` of the optimizer's query, with the params
    derived from its current global state (as the vectorized path's preprocess_record). Call
    it inside the traced step.

    Returns:
      a callable float32 norms [R] -> factors [R].
    Raises:
      ValueError: the sampling is not declared yet (see `set_sampling`).
      NotImplementedError: the query gives no clip factors (`clips_by_factors` is False).
    """
    query = self._require_query()
    params = self._dp_params()
    return lambda norms: query.record_clip_factors(params, norms)

  # ---- sampling -----------------------------------------------------------------------

  def set_sampling(self, population_size, selection_probability, policy="poisson",
                   sample_size=0):
    """Declares how batches are sampled; the ledger records it with every step.

    With num_microbatches M a record is a microbatch of k = ceil(sample_size / M) examples
    (`examples_per_record`); the ledger then charges a clipped sum at sensitivity 2S
    (McMahan et al. 2018, Table 1 and Appendix A). Microbatches need a policy whose positions come
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
      self._dp_expected_records.assign(
          expected_records(policy, population_size, selection_probability, sample_size))
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
    given = getattr(self, "_dp_given_params", None)
    if given is not None:
      return given
    query = self._require_query()
    return query.derive_sample_params(self._dp_global_state())

  def sample_params(self):
    """The query's sample params for this step, derived from its global state (read here).

    Returns:
      the params nest (`DPQuery.derive_sample_params`).
    """
    return self._dp_params()

  @contextlib.contextmanager
  def given_sample_params(self, params):
    """Within the block the clipping uses `params` instead of reading the query's global
    state: an XLA-compiled clipped sum receives them as arguments, so it reads no
    variable that lives on another device (under tf.distribute each replica compiles its
    own program, and the global state is one variable on the first device).

    Args:
      params: a nest from `sample_params()` (None: read the state as usual).
    Yields:
      None.
    """
    old = getattr(self, "_dp_given_params", None)
    self._dp_given_params = params
    try:
      yield
    finally:
      self._dp_given_params = old

  # ---- noise, ledger ------------------------------------------------------------------

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
    noise is drawn once, in cross-replica context.

    Args:
      sample_state: the clipped sum of this replica's records (the query's sample state).
      num_records: records in this replica's batch (the denominator, unless a Poisson-type
        policy: `expected_records`).
    Returns:
      the list of noised average gradients (flattened result, pre-divided by the replicas).
    Raises:
      ValueError: the sampling is not declared (`set_sampling`).
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
    elif self._dp_query.policy in EXPECTED_SIZE_POLICIES:
      denom = self._dp_expected_records.read_value()
    else:
      denom = tf.maximum(num_records, 1.0)
    # Keras sums gradients over replicas in apply(): pre-divide by the replica count.
    denom = denom * float(n_rep)
    return [tf.cast(r / tf.cast(denom, r.dtype), r.dtype) for r in tf.nest.flatten(result)]
