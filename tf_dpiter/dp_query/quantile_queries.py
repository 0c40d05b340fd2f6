"""Private adaptive clipping (Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private
Learning with Adaptive Clipping", Section 2).

Each record contributes b = 1[x <= C] - 1/2 (L2 sensitivity 1/2); b_bar = (sum b +
N(0, sigma_b^2)) / expected_num_records + 1/2; C <- C exp(-eta (b_bar - gamma)) (geometric) or
C - eta (b_bar - gamma). The value query's z_v = (z^-2 - (2 sigma_b)^-2)^(-1/2) makes the two
queries together z (Eq. (1) of McMahan et al. 2018).
"""

import collections

import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import randomness
from tf_dpiter.dp_query import serialization
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError

_BELOW_SENSITIVITY = 0.5


@serialization.register_query()
class QuantileEstimatorQuery(dp_query.SumAggregationDPQuery):
  """Private estimate of the `target_quantile` of scalar records (Andrew et al. 2021).

  Event per sample: GaussianSumEvent(1/2, sigma_b) (module docstring).

  Args:
    initial_estimate: C_0 >= 0, finite.
    target_quantile: gamma in [0, 1].
    learning_rate: eta >= 0.
    below_estimate_stddev: sigma_b, the noise on the sum of the b's.
    expected_num_records: the (public) expected sample size, the denominator of b_bar.
    geometric_update: geometric (default) or linear update.
    seed: fixes the noise (tests only: not private).
    generator: a generator shared with a parent query (then not serializable).

  Raises:
    PrivacyConfigError: a value out of range.
  """

  _GlobalState = collections.namedtuple(
      "_GlobalState", ["current_estimate", "target_quantile", "learning_rate",
                       "below_estimate_stddev", "expected_num_records"])

  def __init__(self, initial_estimate, target_quantile, learning_rate, below_estimate_stddev,
               expected_num_records, geometric_update=True, seed=None, generator=None):
    validation.check_nonnegative("initial_estimate", initial_estimate, allow_inf=False)
    validation.check_probability("target_quantile", target_quantile, allow_zero=True)
    validation.check_nonnegative("learning_rate", learning_rate, allow_inf=False)
    validation.check_nonnegative("below_estimate_stddev", below_estimate_stddev, allow_inf=False)
    validation.check_positive("expected_num_records", expected_num_records)
    self._initial_estimate = initial_estimate
    self._target_quantile = target_quantile
    self._learning_rate = learning_rate
    self._below_estimate_stddev = below_estimate_stddev
    self._expected_num_records = expected_num_records
    self._geometric_update = geometric_update
    self._seed = seed
    self._shared_generator = generator is not None
    self._generator = generator or randomness.make_generator(seed)

  def get_config(self):
    """See `DPQuery.get_config`: the constructor's arguments.

    Raises:
      ParameterValueError: the query was built with a shared `generator` (not a config value).
    """
    if self._shared_generator:
      raise ParameterValueError("a QuantileEstimatorQuery given a `generator` cannot be serialized (a "
                                "generator is not a config value); build it with `seed` instead")
    p = serialization.plain
    return {"initial_estimate": p(self._initial_estimate),
            "target_quantile": p(self._target_quantile),
            "learning_rate": p(self._learning_rate),
            "below_estimate_stddev": p(self._below_estimate_stddev),
            "expected_num_records": p(self._expected_num_records),
            "geometric_update": bool(self._geometric_update), "seed": p(self._seed)}

  def initial_global_state(self):
    f = lambda x: tf.cast(x, tf.float32)
    return self._GlobalState(f(self._initial_estimate), f(self._target_quantile),
                             f(self._learning_rate), f(self._below_estimate_stddev),
                             f(self._expected_num_records))

  @staticmethod
  def set_expected_num_records(global_state, expected_num_records):
    """Global state with a new expected sample size (e.g. a schedule of m_t clients).

    Args:
      global_state: the current global state.
      expected_num_records: > 0.

    Returns:
      the new global state.

    Raises:
      PrivacyConfigError: expected_num_records <= 0.
    """
    validation.check_positive("expected_num_records", expected_num_records)
    return global_state._replace(expected_num_records=tf.cast(expected_num_records, tf.float32))

  def derive_sample_params(self, global_state):
    return global_state.current_estimate

  def initial_sample_state(self, template=None):
    return tf.constant(0.0)

  def preprocess_record(self, params, record):
    return tf.cast(tf.cast(record, tf.float32) <= params, tf.float32) - 0.5

  def update_estimate(self, below_sum, global_state):
    """New global state from the (un-noised) sum of b values.

    Args:
      below_sum: sum of b = 1[x <= C] - 1/2 over the sample.
      global_state: the current state.

    Returns:
      (new global state, GaussianSumEvent(1/2, sigma_b)).
    """
    noised = gaussian_query.add_gaussian_noise(self._generator, below_sum,
                                               global_state.below_estimate_stddev)
    denom = global_state.expected_num_records
    below_fraction = tf.clip_by_value(noised / denom + 0.5, 0.0, 1.0)
    step = global_state.learning_rate * (below_fraction - global_state.target_quantile)
    new_estimate = (global_state.current_estimate * tf.exp(-step) if self._geometric_update
                    else tf.maximum(0.0, global_state.current_estimate - step))
    event = events_lib.GaussianSumEvent(tf.constant(_BELOW_SENSITIVITY),
                                        global_state.below_estimate_stddev)
    return global_state._replace(current_estimate=new_estimate), event

  def get_noised_result(self, sample_state, global_state):
    new_state, event = self.update_estimate(sample_state, global_state)
    return new_state.current_estimate, new_state, (event,)

  def derive_metrics(self, global_state):
    return collections.OrderedDict(estimate=global_state.current_estimate)


def value_noise_multiplier(noise_multiplier, clipped_count_stddev):
  """z_v = (z^-2 - (2 sigma_b)^-2)^(-1/2): the value query's share of a total z.

  Args:
    noise_multiplier: the total z >= 0 (0: no noise, z_v = 0).
    clipped_count_stddev: sigma_b, > z / 2.

  Returns:
    z_v, a float.

  Raises:
    PrivacyConfigError: a bad z or sigma_b, or sigma_b <= z / 2 (the count alone would cost
      more than z).
  """
  validation.check_nonnegative("noise_multiplier", noise_multiplier, allow_inf=False)
  validation.check_nonnegative("clipped_count_stddev", clipped_count_stddev, allow_inf=False)
  if noise_multiplier == 0:
    return 0.0
  if clipped_count_stddev <= noise_multiplier / 2:
    raise PrivacyConfigError(
        f"clipped_count_stddev must exceed noise_multiplier/2 = {noise_multiplier / 2} so that "
        f"the count's cost fits in the total noise multiplier, got {clipped_count_stddev!r} "
        "(Andrew et al. suggest expected_num_records / 20)")
  return (noise_multiplier ** -2 - (2.0 * clipped_count_stddev) ** -2) ** -0.5


@serialization.register_query()
class QuantileAdaptiveClipSumQuery(dp_query.SumAggregationDPQuery):
  """Gaussian sum query whose clip follows a private quantile of the record norms.

  Events: GaussianSumEvent(C, z_v C) and GaussianSumEvent(1/2, sigma_b), together z.

  Args:
    initial_l2_norm_clip: C_0 > 0, finite (a geometric update keeps C = 0 at 0).
    noise_multiplier: the total z (value and count queries together).
    target_unclipped_quantile: gamma in [0, 1].
    learning_rate: eta of the clip update.
    clipped_count_stddev: sigma_b, > z / 2 (Andrew et al. suggest expected_num_records / 20).
    expected_num_records: the public expected sample size.
    geometric_update: geometric (default) or linear clip update.
    seed: fixes the noise (tests only: not private).

  Raises:
    PrivacyConfigError: a value out of range (see value_noise_multiplier).
  """

  _GlobalState = collections.namedtuple(
      "_GlobalState", ["l2_norm_clip", "value_noise_multiplier", "quantile_state"])

  def __init__(self, initial_l2_norm_clip, noise_multiplier, target_unclipped_quantile,
               learning_rate, clipped_count_stddev, expected_num_records,
               geometric_update=True, seed=None):
    validation.check_positive("initial_l2_norm_clip", initial_l2_norm_clip, allow_inf=False)
    self._noise_multiplier = noise_multiplier
    self._config = {"initial_l2_norm_clip": initial_l2_norm_clip,
                    "noise_multiplier": noise_multiplier,
                    "target_unclipped_quantile": target_unclipped_quantile,
                    "learning_rate": learning_rate, "clipped_count_stddev": clipped_count_stddev,
                    "expected_num_records": expected_num_records,
                    "geometric_update": bool(geometric_update), "seed": seed}
    self._value_z = value_noise_multiplier(noise_multiplier, clipped_count_stddev)
    self._generator = randomness.make_generator(seed)
    self._quantile = QuantileEstimatorQuery(
        initial_l2_norm_clip, target_unclipped_quantile, learning_rate, clipped_count_stddev,
        expected_num_records, geometric_update, generator=self._generator)

  @property
  def noise_multiplier(self):
    """z, the total noise multiplier of a sample (value and count queries, Eq. (1))."""
    return self._noise_multiplier

  def get_config(self):
    return {k: serialization.plain(v) for k, v in self._config.items()}

  def set_expected_num_records(self, global_state, expected_num_records):
    """Global state whose quantile estimator expects `expected_num_records` records.

    Args:
      global_state: the current global state.
      expected_num_records: > 0.

    Returns:
      the new global state.
    """
    return global_state._replace(quantile_state=self._quantile.set_expected_num_records(
        global_state.quantile_state, expected_num_records))

  def initial_global_state(self):
    qstate = self._quantile.initial_global_state()
    return self._GlobalState(qstate.current_estimate, tf.constant(self._value_z, tf.float32),
                             qstate)

  # The sample params are the global state's clip (the current clip C), as in the Gaussian sum.
  derive_sample_params = gaussian_query.GaussianSumQuery.derive_sample_params

  def initial_sample_state(self, template):
    return (dp_query.zeros_like_template(template), tf.constant(0.0))

  def preprocess_record(self, params, record):
    clipped, norm = dp_query.clip_by_global_l2_norm(record, params)
    return (clipped, self._quantile.preprocess_record(params, norm))

  def get_noised_result(self, sample_state, global_state):
    value_sum, below_sum = sample_state
    clip = global_state.l2_norm_clip
    value_stddev = gaussian_query.gaussian_stddev(clip, global_state.value_noise_multiplier)
    result = gaussian_query.add_gaussian_noise(self._generator, value_sum, value_stddev)
    new_qstate, count_event = self._quantile.update_estimate(below_sum, global_state.quantile_state)
    new_state = global_state._replace(l2_norm_clip=new_qstate.current_estimate,
                                      quantile_state=new_qstate)
    events = (events_lib.GaussianSumEvent(clip, value_stddev), count_event)
    return result, new_state, events

  def derive_metrics(self, global_state):
    return collections.OrderedDict(clip=global_state.l2_norm_clip)
