"""A DPQuery wrapper that writes every sample and its queries to a PrivacyLedger.

McMahan et al., "A General Approach to Adding Differential Privacy to Iterative Training
Procedures" (2018), Section 6: the training code never computes privacy; the wrapper records, at each
`get_noised_result`, one sampling event (n, q, sample size, policy) with all the sum query
events the inner query reports.
"""

import math

import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import serialization
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import policies
from tf_dpiter.ledger import privacy_ledger
from tf_dpiter.ledger import records


_SAMPLE_SIZE = ("a finite number >= 0, the batch size: the expected one under \"poisson\" "
                "(q * n; 0 when not known) and the number of examples per batch under "
                "\"shuffle\" and \"fixed_size\"; pass it, or leave the default")


def check_sample_size(sample_size):
  """Refuses a declared sample size that is not a finite number >= 0 (e.g. None).

  Args:
    sample_size: the batch size of a sampling declaration.

  Returns:
    float(sample_size), or a tensor unchanged (checked by the policy when it is read).

  Raises:
    ParameterTypeError: `sample_size` is not a number (None, a string, a bool).
    PrivacyConfigError: `sample_size` is negative, NaN or infinite.
  """
  if tf.is_tensor(sample_size):
    return sample_size
  try:
    value = validation.check_number("sample_size", sample_size)
  except ParameterTypeError:
    raise ParameterTypeError(
        validation.message("sample_size", _SAMPLE_SIZE, sample_size)) from None
  if not math.isfinite(value) or value < 0:
    raise PrivacyConfigError(validation.message("sample_size", _SAMPLE_SIZE, sample_size))
  return value


@serialization.register_query()
class QueryWithLedger(dp_query.DPQuery):
  """Wraps a top-level query; each get_noised_result records one sample in `ledger`."""

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
    privacy_ledger.policy_code(policy)
    self._check_sampling(population_size, selection_probability, sample_size, policy)
    records.check_examples_per_record(policy, examples_per_record)
    self._examples_per_record = int(examples_per_record)
    self._query = query
    self._policy = policy
    self._ledger = ledger if ledger is not None else privacy_ledger.PrivacyLedger()
    self._population_size = tf.Variable(float(population_size), dtype=tf.float64,
                                        trainable=False, name="population_size")
    self._selection_probability = tf.Variable(float(selection_probability), dtype=tf.float64,
                                              trainable=False, name="selection_probability")
    self._sample_size = tf.Variable(float(sample_size), dtype=tf.float64, trainable=False,
                                    name="sample_size")

  @staticmethod
  def _check_sampling(population_size, selection_probability, sample_size, policy):
    validation.check_positive("population_size", population_size)
    validation.check_probability("selection_probability", selection_probability)
    check_sample_size(sample_size)
    if policy == records.REPEAT_AND_SELECT:
      raise PrivacyConfigError(f"{policy!r} marks a private selection (tf_dpiter.tuning), "
                               "not a sampling policy")
    bad = policies.get(policy).check_sampling(population_size, selection_probability,
                                              sample_size)
    if bad is not None:
      raise PrivacyConfigError(bad)

  @property
  def ledger(self):
    """The PrivacyLedger every `get_noised_result` writes to."""
    return self._ledger

  def get_config(self):
    """The wrapped query and the current sampling. The ledger is state, not config: a query
    rebuilt from this config writes to a fresh ledger (save the ledger with save_json)."""
    return {"query": serialization.serialize(self._query),
            "population_size": float(self._population_size.numpy()),
            "selection_probability": float(self._selection_probability.numpy()),
            "policy": self._policy, "sample_size": float(self._sample_size.numpy()),
            "examples_per_record": self._examples_per_record}

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

  @property
  def population_size(self):
    """n recorded with the following samples (float64 tensor; `set_sampling` changes it)."""
    return self._population_size.read_value()

  @property
  def selection_probability(self):
    """q recorded with the following samples (float64 tensor)."""
    return self._selection_probability.read_value()

  @property
  def sample_size(self):
    """The batch size recorded with the following samples (float64 tensor; 0 for Poisson)."""
    return self._sample_size.read_value()

  @property
  def policy(self):
    """The sampling policy recorded with every sample (one of ledger.POLICIES)."""
    return self._policy

  @property
  def examples_per_record(self):
    """k, the examples in one record (1: a record is an example; k > 1: a microbatch)."""
    return self._examples_per_record

  def set_sampling(self, population_size, selection_probability, sample_size=None,
                   examples_per_record=None):
    """Changes n, q (sample size, examples per record) for the following samples.

    A change of examples_per_record takes effect at the next trace of a tf.function.

    Args:
      population_size: n > 0.
      selection_probability: q in (0, 1].
      sample_size: the batch size (required in [1, n] for fixed_size and shuffle; None keeps the
        current one).
      examples_per_record: k >= 1 (None keeps it).

    Raises:
      PrivacyConfigError: a value out of range, or k > 1 under an add/remove policy.
    """
    if sample_size is None:
      sample_size = float(self._sample_size.numpy())
    self._check_sampling(population_size, selection_probability, sample_size, self._policy)
    if examples_per_record is not None:
      records.check_examples_per_record(self._policy, examples_per_record)
      self._examples_per_record = int(examples_per_record)
    self._population_size.assign(float(population_size))
    self._selection_probability.assign(float(selection_probability))
    self._sample_size.assign(float(sample_size))

  def initial_global_state(self):
    """The wrapped query's initial global state."""
    return self._query.initial_global_state()

  def derive_sample_params(self, global_state):
    """The wrapped query's sample params of `global_state`.

    Args:
      global_state: the query's global state (from `initial_global_state`, or returned by the
        previous `get_noised_result`).
    """
    return self._query.derive_sample_params(global_state)

  def initial_sample_state(self, template):
    """The wrapped query's empty sample state shaped like `template`.

    Args:
      template: a nest of tensors or tf.TensorSpecs with the structure, shapes and dtypes of a
        record.
    """
    return self._query.initial_sample_state(template)

  def preprocess_record(self, params, record):
    """The wrapped query's preprocessing (clipping) of one record.

    Args:
      params: the sample params (`derive_sample_params` of the global state).
      record: one record: a nest of tensors with the structure of the template.
    """
    return self._query.preprocess_record(params, record)

  def record_clip_factors(self, params, record_norms):
    """The wrapped query's clip factors for per-record norms computed elsewhere.

    Args:
      params: the sample params (`derive_sample_params` of the global state).
      record_norms: [num_records] the records' L2 norms.
    """
    return self._query.record_clip_factors(params, record_norms)

  def accumulate_records(self, params, sample_state, records, mask=None):
    """The wrapped query's accumulation of a batch of records (mask: 0 for padding).

    Args:
      params: the sample params (`derive_sample_params` of the global state).
      sample_state: the sample state accumulated over the records of this sample.
      records: a batch of records: a nest of tensors with a leading record axis.
      mask: None, or a [num_records] tensor: 1 for a real record, 0 for padding (not counted).
    """
    return self._query.accumulate_records(params, sample_state, records, mask)

  def accumulate_preprocessed_record(self, sample_state, preprocessed_record):
    """The wrapped query's accumulation of one preprocessed record.

    Args:
      sample_state: the sample state accumulated over the records of this sample.
      preprocessed_record: one record as `preprocess_record` returned it (clipped).
    """
    return self._query.accumulate_preprocessed_record(sample_state, preprocessed_record)

  def sample_state_of_sum(self, template, preprocessed_sum):
    """The wrapped query's sample state holding a sum of preprocessed records."""
    return self._query.sample_state_of_sum(template, preprocessed_sum)

  def merge_sample_states(self, sample_state_1, sample_state_2):
    """The wrapped query's merge of two sample states.

    Args:
      sample_state_1: a sample state (the sum over some of the records).
      sample_state_2: another sample state, of the other records.
    """
    return self._query.merge_sample_states(sample_state_1, sample_state_2)

  def get_noised_result(self, sample_state, global_state):
    """The inner query's result; records the sample (n, q, policy, events) in the ledger.

    Args:
      sample_state: the sample state accumulated over the records of this sample.
      global_state: the query's global state (from `initial_global_state`, or returned by the
        previous `get_noised_result`).
    """
    result, new_state, events = self._query.get_noised_result(sample_state, global_state)
    count = self.record(events)
    with tf.control_dependencies([count]):
      result = tf.nest.map_structure(tf.identity, result)
    return result, new_state, events

  def record(self, events):
    """Records one sample (n, q, policy, sample size, k) with `events`, the events the
    wrapped query's `get_noised_result` returned for it. `get_noised_result` calls it; an
    XLA-compiled step calls the wrapped query's `get_noised_result` inside the program and
    this outside it (the ledger's buffers grow), so the event recorded is always the one the
    code that drew the noise built.

    Args:
      events: the tuple of privacy events of one noised result.

    Returns:
      the ledger's new sample count (int64 tensor).
    """
    return self._ledger.record_sample(self._population_size, self._selection_probability,
                                      events, policy=self._policy, sample_size=self._sample_size,
                                      examples_per_record=self._examples_per_record)

  def derive_metrics(self, global_state):
    """The wrapped query's metrics of `global_state`.

    Args:
      global_state: the query's global state (from `initial_global_state`, or returned by the
        previous `get_noised_result`).
    """
    return self._query.derive_metrics(global_state)
