"""The declared sampling of a ledger's samples, and a DPQuery wrapper that records with it.

McMahan et al., "A General Approach to Adding Differential Privacy to Iterative Training
Procedures" (2018), Section 6: the training code never computes privacy; each noised result
is recorded as one sampling event (population size n, selection probability q, sample size,
policy, examples per record k) with all the sum query events the query that drew the noise
reports. `LedgerSampling` holds that declaration and its ledger and writes one sample per
`record(events)`: the DP optimizers' step calls its own query and then `record` (the events
are the ones the code that drew the noise built). `QueryWithLedger` is the same recording as
a DPQuery wrapper (each `get_noised_result` records), for code that drives a query itself
(federated servers, TF Privacy's habit of reading `optimizer.dp_query`).
"""

import math
import typing

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


@typing.final
class LedgerSampling:
  """The sampling of the following samples (n, q, policy, sample size, k) and the ledger
  each `record` writes one sample to.

  n, q and the sample size are float64 variables (`set_sampling` changes them without a
  retrace); the policy is fixed; k takes effect at the next trace of a tf.function.
  """

  def __init__(self, population_size, selection_probability, ledger=None,
               policy=privacy_ledger.POISSON, sample_size=0, examples_per_record=1):
    """Checks the declaration and makes its variables.

    Args:
      population_size: n > 0.
      selection_probability: q in (0, 1].
      ledger: a PrivacyLedger (a new one by default).
      policy: one of ledger.POLICIES.
      sample_size: the batch size (required in [1, n] for fixed_size and shuffle).
      examples_per_record: k, the microbatch size (1: a record is an example).

    Raises:
      PrivacyConfigError: a value out of range (sample_size not a finite number >= 0
        included), or k > 1 under an add/remove policy.
    """
    privacy_ledger.policy_code(policy)
    self._check(population_size, selection_probability, sample_size, policy)
    self._policy = policy
    self._policy_object = policies.get(policy)
    self._set_examples_per_record(examples_per_record)
    self._ledger = ledger if ledger is not None else privacy_ledger.PrivacyLedger()
    self._population_size = tf.Variable(float(population_size), dtype=tf.float64,
                                        trainable=False, name="population_size")
    self._selection_probability = tf.Variable(float(selection_probability), dtype=tf.float64,
                                              trainable=False, name="selection_probability")
    self._sample_size = tf.Variable(float(sample_size), dtype=tf.float64, trainable=False,
                                    name="sample_size")

  @staticmethod
  def _check(population_size, selection_probability, sample_size, policy):
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

  def _set_examples_per_record(self, examples_per_record):
    """Checks k against the policy and forms the sensitivity factor every `record` writes
    (records.sensitivity_factor), once per declaration.

    Raises:
      PrivacyConfigError: k > 1 under an add/remove policy. ParameterValueError: k < 1.
    """
    records.check_examples_per_record(self._policy, examples_per_record)
    self._examples_per_record = int(examples_per_record)
    self._factor = records.sensitivity_factor(self._policy_object.relation,
                                              self._examples_per_record)

  @property
  def ledger(self):
    """The PrivacyLedger every `record` writes to."""
    return self._ledger

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

  def config(self):
    """The declaration as plain numbers: {"population_size", "selection_probability",
    "policy", "sample_size", "examples_per_record"} (n, q, B as Python floats)."""
    return {"population_size": float(self._population_size.numpy()),
            "selection_probability": float(self._selection_probability.numpy()),
            "policy": self._policy, "sample_size": float(self._sample_size.numpy()),
            "examples_per_record": self._examples_per_record}

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
    self._check(population_size, selection_probability, sample_size, self._policy)
    if examples_per_record is not None:
      self._set_examples_per_record(examples_per_record)
    self._population_size.assign(float(population_size))
    self._selection_probability.assign(float(selection_probability))
    self._sample_size.assign(float(sample_size))

  def record(self, events):
    """Records one sample (n, q, policy, sample size, k) with `events`, the events of one
    noised result as the query that drew the noise returned them (also when that draw ran
    inside an XLA program: this runs outside it, the ledger's buffers grow).

    Args:
      events: the tuple of privacy events of one noised result.

    Returns:
      the ledger's new sample count (int64 tensor).
    """
    return self._ledger.append_sample(self._population_size, self._selection_probability,
                                      events, self._policy_object, self._sample_size,
                                      self._examples_per_record, self._factor)


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
