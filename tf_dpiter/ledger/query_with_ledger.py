"""A DPQuery wrapper that records every noised result in a ledger.

McMahan et al., "A General Approach to Adding Differential Privacy to Iterative Training
Procedures" (2018), Section 6: each noised result is recorded as one sampling event with the
sum query events the query reports. `QueryWithLedger` does that for code that drives a query
itself (federated servers, TF Privacy's `optimizer.dp_query`); the DP optimizers' step
records with its `LedgerSampling` directly.
"""

import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import serialization
from tf_dpiter.ledger import privacy_ledger
from tf_dpiter.ledger.privacy_ledger import LedgerSampling


@serialization.register_query()
class QueryWithLedger(dp_query.DPQuery):
  """Wraps a top-level query; each get_noised_result records one sample (LedgerSampling)."""

  def __init__(self, query, population_size, selection_probability, ledger=None,
               policy=privacy_ledger.POISSON, sample_size=0, examples_per_record=1):
    """Wraps `query`; every get_noised_result records one sample in `ledger`.

    Args:
      query: the top-level DPQuery.
      population_size: n > 0.
      selection_probability: q in (0, 1].
      ledger: a PrivacyLedger (a new one by default).
      policy: one of ledger.POLICIES.
      sample_size: the batch size (required in [1, n] for fixed_size and shuffle).
      examples_per_record: k, the microbatch size (1: a record is an example).

    Raises:
      ParameterTypeError: `query` is not a DPQuery.
      PrivacyConfigError: a value out of range (sample_size not a finite number >= 0
        included), or k > 1 under an add/remove policy.
    """
    validation.check_instance("query", query, dp_query.DPQuery, "a DPQuery")
    self._query = query
    self._sampling = LedgerSampling(population_size, selection_probability, ledger=ledger,
                                    policy=policy, sample_size=sample_size,
                                    examples_per_record=examples_per_record)

  @classmethod
  def sharing(cls, query, sampling):
    """`query` wrapped so that it records with `sampling` (the same variables, the same
    ledger): what either changes or records, the other sees.

    Args:
      query: the top-level DPQuery.
      sampling: a LedgerSampling.

    Returns:
      a QueryWithLedger.

    Raises:
      ParameterTypeError: `query` is not a DPQuery, or `sampling` not a LedgerSampling.
    """
    validation.check_instance("query", query, dp_query.DPQuery, "a DPQuery")
    validation.check_instance("sampling", sampling, LedgerSampling, "a ledger.LedgerSampling")
    wrapper = cls.__new__(cls)
    wrapper._query = query   # pylint: disable=protected-access
    wrapper._sampling = sampling   # pylint: disable=protected-access
    return wrapper

  @property
  def sampling(self):
    """The LedgerSampling every `get_noised_result` records with."""
    return self._sampling

  @property
  def ledger(self):
    """The PrivacyLedger every `get_noised_result` writes to."""
    return self._sampling.ledger

  def get_config(self):
    """The wrapped query and the current sampling. The ledger is state, not config: a query
    rebuilt from this config writes to a fresh ledger (save the ledger with save_json)."""
    return {"query": serialization.serialize(self._query), **self._sampling.config()}

  @classmethod
  def from_config(cls, config):
    """Inverse of `get_config` (a fresh ledger).

    Args:
      config: a dict from get_config.

    Returns:
      a QueryWithLedger.
    """
    config = dict(config)
    config["query"] = serialization.deserialize(config["query"])
    return cls(**config)

  @property
  def query(self):
    """The wrapped DPQuery."""
    return self._query

  population_size = property(lambda self: self._sampling.population_size,
                             doc=LedgerSampling.population_size.__doc__)
  selection_probability = property(lambda self: self._sampling.selection_probability,
                                   doc=LedgerSampling.selection_probability.__doc__)
  sample_size = property(lambda self: self._sampling.sample_size,
                         doc=LedgerSampling.sample_size.__doc__)
  policy = property(lambda self: self._sampling.policy, doc=LedgerSampling.policy.__doc__)
  examples_per_record = property(lambda self: self._sampling.examples_per_record,
                                 doc=LedgerSampling.examples_per_record.__doc__)

  def set_sampling(self, population_size, selection_probability, sample_size=None,
                   examples_per_record=None):
    """LedgerSampling.set_sampling of the sampling it records with.

    Args:
      population_size: n > 0.
      selection_probability: q in (0, 1].
      sample_size: the batch size (None keeps the current one).
      examples_per_record: k >= 1 (None keeps it).

    Raises:
      PrivacyConfigError: a value out of range, or k > 1 under an add/remove policy.
    """
    self._sampling.set_sampling(population_size, selection_probability, sample_size,
                                examples_per_record)

  # The DPQuery contract's methods, forwarded to the wrapped query unchanged.
  initial_global_state = dp_query.forwarded("initial_global_state", "_query")
  derive_sample_params = dp_query.forwarded("derive_sample_params", "_query")
  initial_sample_state = dp_query.forwarded("initial_sample_state", "_query")
  preprocess_record = dp_query.forwarded("preprocess_record", "_query")
  record_clip_factors = dp_query.forwarded("record_clip_factors", "_query")
  accumulate_records = dp_query.forwarded("accumulate_records", "_query")
  accumulate_preprocessed_record = dp_query.forwarded("accumulate_preprocessed_record", "_query")
  sample_state_of_sum = dp_query.forwarded("sample_state_of_sum", "_query")
  merge_sample_states = dp_query.forwarded("merge_sample_states", "_query")
  derive_metrics = dp_query.forwarded("derive_metrics", "_query")

  def get_noised_result(self, sample_state, global_state):
    """The inner query's result; records the sample (n, q, policy, events) in the ledger.

    Args:
      sample_state: the sample state accumulated over the records of this sample.
      global_state: the query's global state (from `initial_global_state`, or returned by the
        previous `get_noised_result`).
    """
    result, new_state, events = self._query.get_noised_result(sample_state, global_state)
    count = self._sampling.record(events)
    with tf.control_dependencies([count]):
      result = tf.nest.map_structure(tf.identity, result)
    return result, new_state, events

  def record(self, events):
    """LedgerSampling.record: one sample with `events` (the wrapped query's
    `get_noised_result` events, e.g. of a draw made inside an XLA program).

    Args:
      events: the tuple of privacy events of one noised result.

    Returns:
      the ledger's new sample count (int64 tensor).
    """
    return self._sampling.record(events)
