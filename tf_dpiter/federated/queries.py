"""Aggregation queries for client-level DP federated averaging.

`MedianNormClipSumQuery`: the clip of Geyer et al. 2017 (Section 3, "Choosing S"), S_t the
median of the round's unclipped update norms, updates clipped to S_t, the sum plus
N(0, (sigma S_t)^2). The median is computed WITHOUT a randomized mechanism, so the run is NOT
differentially private (the ledger records the event applied, but its (epsilon, delta) does
not hold); prefer `dp_query.QuantileAdaptiveClipSumQuery` (Andrew et al. 2021).
`set_noise_multiplier` changes sigma_t between rounds (Geyer et al. 2017, Section 6);
`make_query` builds a round's query by kind (`QUERY_KINDS`).
"""

import collections

import tensorflow as tf

from tf_dpiter import dp_query as dpq
from tf_dpiter import validation
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import quantile_queries
from tf_dpiter.dp_query import randomness
from tf_dpiter.dp_query import serialization
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError

NOT_PRIVATE_WARNING = (
    "median-norm clipping (Geyer et al. 2017) sets the clip S_t to the median of the unclipped update "
    "norms without a randomized mechanism: the reported (epsilon, delta) is computed as if "
    "S_t were fixed in advance and the guarantee DOES NOT HOLD for this run")


def median_of_masked(values, mask):
  """Median of values[mask > 0] (mean of the two middle values for an even count).

  Args:
    values: float [n].
    mask: [n], rows with mask > 0 count.

  Returns:
    a scalar float32 tensor; 0 when the mask selects nothing.
  """
  values = tf.convert_to_tensor(values, tf.float32)
  mask = tf.cast(mask, tf.bool)
  v = tf.sort(tf.boolean_mask(values, mask))
  n = tf.shape(v)[0]
  return tf.cond(n > 0, lambda: 0.5 * (v[(n - 1) // 2] + v[n // 2]), lambda: tf.constant(0.0))


@serialization.register_query()
class MedianNormClipSumQuery(dpq.DPQuery):
  """Sum of records clipped to the median record norm of the sample, plus N(0, (z S)^2).

  NOT differentially private (module docstring). Records are flat float32 vectors [d]; the
  sample state keeps them unclipped with a mask until the whole sample is seen (memory grows
  with the sample size). The global state is (z, the last clip S_t).

  Args:
    noise_multiplier: z (sigma in Geyer et al. 2017): the noise stddev is z * S_t.
    initial_l2_norm_clip: S used only to report events before any sample was seen
      (the budget look-ahead of the first round).
    seed: fixes the noise (tests only: the output is then not private).
  """

  _GlobalState = collections.namedtuple("_GlobalState", ["noise_multiplier", "l2_norm_clip"])

  not_private_warning = NOT_PRIVATE_WARNING

  def __init__(self, noise_multiplier, initial_l2_norm_clip=1.0, seed=None):
    validation.check_nonnegative("noise_multiplier", noise_multiplier, allow_inf=False)
    validation.check_positive("initial_l2_norm_clip", initial_l2_norm_clip, allow_inf=False)
    self._noise_multiplier = noise_multiplier
    self._initial_clip = initial_l2_norm_clip
    self._seed = seed
    self._generator = dpq.make_generator(seed)

  def get_config(self):
    p = serialization.plain
    return {"noise_multiplier": p(self._noise_multiplier),
            "initial_l2_norm_clip": p(self._initial_clip), "seed": p(self._seed)}

  def initial_global_state(self):
    return self._GlobalState(tf.constant(float(self._noise_multiplier), tf.float32),
                             tf.constant(float(self._initial_clip), tf.float32))

  def initial_sample_state(self, template):
    """See `DPQuery.initial_sample_state`: (records [0, d], mask [0]), empty.

    Args:
      template: a nest of tensors or tf.TensorSpecs with the structure, shapes and dtypes of a
        record.

    Raises:
      ParameterValueError: the template is not a flat record [d].
    """
    spec = template if isinstance(template, tf.TensorSpec) else tf.TensorSpec(
        tf.convert_to_tensor(template).shape, tf.float32)
    if spec.shape.rank != 1:
      raise ParameterValueError(f"template must describe a flat record [d], got shape {spec.shape}")
    return (tf.zeros([0, spec.shape[0]], tf.float32), tf.zeros([0], tf.float32))

  def preprocess_record(self, params, record):
    # The clip depends on the whole sample: records are kept as they are until the end.
    return tf.convert_to_tensor(record, tf.float32)

  def accumulate_preprocessed_record(self, sample_state, preprocessed_record):
    return self.merge_sample_states(sample_state, (preprocessed_record[None], tf.ones([1])))

  def accumulate_records(self, params, sample_state, records, mask=None):
    # float32 whatever the server's dtype; a mask entry > 0 keeps its row (the server's
    # mask carries the private queries' clip shrink, meaningless to a median clip)
    records = tf.cast(records, tf.float32)
    mask = (tf.ones(tf.shape(records)[:1]) if mask is None
            else tf.cast(tf.convert_to_tensor(mask) > 0, tf.float32))
    return self.merge_sample_states(sample_state, (records, mask))

  def merge_sample_states(self, sample_state_1, sample_state_2):
    return tuple(tf.concat([a, b], 0) for a, b in zip(sample_state_1, sample_state_2))

  @staticmethod
  def clip_to_median(records, mask):
    """Clips every kept record to the median of their norms.

    Args:
      records: float32 [n, d].
      mask: [n] 0/1.

    Returns:
      (clipped records [n, d], median S): each row scaled by min(1, S / ||row||); rows with
      mask 0 are zeroed; rows with norm > S end with norm exactly S.
    """
    norms = tf.norm(records, axis=1)
    s = median_of_masked(norms, mask)
    factor = tf.minimum(1.0, s / tf.maximum(norms, 1e-30))
    return records * (factor * tf.cast(mask, tf.float32))[:, None], s

  def get_noised_result(self, sample_state, global_state):
    records, mask = sample_state
    has_records = tf.reduce_sum(mask) > 0
    clipped, median = self.clip_to_median(records, mask)
    clip = tf.where(has_records, median, global_state.l2_norm_clip)
    stddev = gaussian_query.gaussian_stddev(clip, global_state.noise_multiplier)
    total = tf.reduce_sum(clipped, axis=0)
    result = total + stddev * randomness.normal(self._generator, tf.shape(total))
    new_state = global_state._replace(l2_norm_clip=clip)
    return result, new_state, (dpq.GaussianSumEvent(clip, stddev),)

  # {"clip": the last S_t}: the metric of the quantile-adaptive clip, one definition.
  derive_metrics = quantile_queries.QuantileAdaptiveClipSumQuery.derive_metrics


def set_noise_multiplier(query, global_state, noise_multiplier):
  """Global state of `query` with its (total) noise multiplier set to z = noise_multiplier.

  Supports GaussianSumQuery (stddev = gaussian_stddev(clip, z)), QuantileAdaptiveClipSumQuery
  (value noise re-derived from the total z, Andrew et al. 2021), MedianNormClipSumQuery, and
  the no-privacy queries (z must be 0).

  Args:
    query: the inner DPQuery of a round.
    global_state: its current global state.
    noise_multiplier: z >= 0, finite.

  Returns:
    the new global state (same structure).

  Raises:
    PrivacyConfigError: a bad z, z != 0 for a no-privacy query, or a query of another kind.
  """
  z = validation.check_nonnegative("noise_multiplier", noise_multiplier, allow_inf=False)
  if isinstance(query, MedianNormClipSumQuery):
    return global_state._replace(noise_multiplier=tf.constant(float(z), tf.float32))
  if isinstance(query, dpq.QuantileAdaptiveClipSumQuery):
    count_stddev = float(global_state.quantile_state.below_estimate_stddev.numpy())
    zv = dpq.value_noise_multiplier(float(z), count_stddev)
    return global_state._replace(value_noise_multiplier=tf.constant(zv, tf.float32))
  if isinstance(query, dpq.GaussianSumQuery):
    return global_state._replace(stddev=tf.cast(
        gaussian_query.gaussian_stddev(global_state.l2_norm_clip, z), tf.float32))
  if isinstance(query, (dpq.NoPrivacySumQuery, dpq.NoPrivacyAverageQuery)):
    if z != 0:
      raise PrivacyConfigError(f"noise_multiplier must be 0 for a no-privacy query, got {z!r}")
    return global_state
  raise PrivacyConfigError(
      f"query: cannot set a noise multiplier schedule on {type(query).__name__}")


QUERY_KINDS = ("quantile", "fixed", "median", "none")


def make_query(kind="quantile", noise_multiplier=1.0, clients_per_round=100, l2_norm_clip=1.0,
               target_unclipped_quantile=0.5, clip_learning_rate=0.2, clipped_count_stddev=None,
               seed=None):
  """The aggregation DPQuery of a round (records: flat client updates).

  Args:
    kind: "quantile" (default; private adaptive clip, Andrew et al. 2021, starting at
      `l2_norm_clip`), "fixed" (GaussianSumQuery with clip S, noise sigma = z S), "median"
      (Geyer et al. 2017's median-norm clip: NOT private) or "none" (plain sum, epsilon = infinity).
    noise_multiplier: z, the total noise multiplier of a round (Eq. (1) of McMahan et al. 2018).
    clients_per_round: m, the expected records per sample (the quantile's denominator).
    l2_norm_clip: S (the initial clip for "quantile" and "median").
    target_unclipped_quantile: the quantile's gamma and eta.
    clip_learning_rate: the quantile's gamma and eta.
    clipped_count_stddev: the count noise sigma_b; default max(m / 20, z) (Andrew et al.
      suggest m / 20; at least z so that the count takes <= 1/4 of the budget).
    seed: fixes the noise (tests only: not private).

  Returns:
    a DPQuery.

  Raises:
    PrivacyConfigError: an unknown kind or a bad value.
  """
  if kind == "quantile":
    m = float(clients_per_round)
    cstd = max(m / 20.0, noise_multiplier) if clipped_count_stddev is None else clipped_count_stddev
    return dpq.QuantileAdaptiveClipSumQuery(
        initial_l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
        target_unclipped_quantile=target_unclipped_quantile, learning_rate=clip_learning_rate,
        clipped_count_stddev=cstd, expected_num_records=m, seed=seed)
  if kind == "fixed":
    return dpq.GaussianSumQuery.from_noise_multiplier(l2_norm_clip, noise_multiplier, seed=seed)
  if kind == "median":
    return MedianNormClipSumQuery(noise_multiplier, l2_norm_clip, seed=seed)
  if kind == "none":
    return dpq.NoPrivacySumQuery()
  raise PrivacyConfigError(f"kind must be one of {QUERY_KINDS}, got {kind!r}")
