"""Per-group clipping over any nest of queries, and the allocation strategies of McMahan et al. 2018.

`NestedQuery` evaluates one query per group of vectors (Section 2, footnote 2). The helpers
pick S_g and sigma~_g per group (Sections 2 and 4); with any of them Eq. (1) gives
z = (sum_g (S_g / sigma~_g)^2)^(-1/2) equal to the requested noise multiplier.
"""

import collections
import functools
import inspect
import math

import numpy as np
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import normalized_query
from tf_dpiter.dp_query import serialization
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError


# The three outputs of `DPQuery.get_noised_result`.
_NoisedResult = collections.namedtuple("_NoisedResult", ["result", "global_state", "events"])


def _per_leaf(name):
  """A NestedQuery method (DPQuery's docstring and signature): `DPQuery.<name>` of every leaf
  query on its part of the arguments."""
  signature = inspect.signature(getattr(dp_query.DPQuery, name))

  @functools.wraps(getattr(dp_query.DPQuery, name), updated=())
  def method(self, *args, **kwargs):
    parts = signature.bind(self, *args, **kwargs).args[1:]
    return self._map(lambda q, *leaf_parts: getattr(q, name)(*leaf_parts), *parts)
  return method


@serialization.register_query()
class NestedQuery(dp_query.SumAggregationDPQuery):
  """A nest (dict, list, tuple) of queries; a record has the same nest structure.

  Events: all leaves', in `tf.nest.flatten` order (McMahan et al. 2018, Section 2; Eq. (1)
  composes them).

  Args:
    queries: a nest of SumAggregationDPQuery leaves (at least one).

  Raises:
    ParameterTypeError: a leaf is not a SumAggregationDPQuery.
    ParameterValueError: no leaf.
  """

  def __init__(self, queries):
    leaves = tf.nest.flatten(queries)
    if not leaves:
      raise ParameterValueError(f"queries must contain at least one DPQuery, got {queries!r}")
    for q in leaves:
      validation.check_instance("queries (every leaf)", q, dp_query.SumAggregationDPQuery,
                                "a SumAggregationDPQuery")
    self._queries = queries

  @property
  def queries(self):
    """The nest of leaf queries, one per group."""
    return self._queries

  def get_config(self):
    return {"queries": serialization.encode_queries(self._queries)}

  @classmethod
  def from_config(cls, config):
    return cls(serialization.decode_queries(config["queries"]))

  def _map(self, fn, *inputs):
    return dp_query.map_up_to(self._queries, fn, self._queries, *inputs)

  # Each leaf query's own method on its own part of every argument (a leaf clips its own
  # part of the record), the nest of the results.
  initial_global_state = _per_leaf("initial_global_state")
  derive_sample_params = _per_leaf("derive_sample_params")
  initial_sample_state = _per_leaf("initial_sample_state")
  preprocess_record = _per_leaf("preprocess_record")
  accumulate_preprocessed_record = _per_leaf("accumulate_preprocessed_record")
  merge_sample_states = _per_leaf("merge_sample_states")

  def get_noised_result(self, sample_state, global_state):
    outs = self._map(lambda q, s, g: _NoisedResult(*q.get_noised_result(s, g)),
                     sample_state, global_state)
    result = self._map(lambda q, out: out.result, outs)
    new_state = self._map(lambda q, out: out.global_state, outs)
    events = tuple(e for out in dp_query.flatten_up_to(self._queries, outs) for e in out.events)
    return result, new_state, events

  def derive_metrics(self, global_state):
    pairs = zip(tf.nest.flatten(self._queries), dp_query.flatten_up_to(self._queries, global_state))
    return {f"group_{i}/{k}": v
            for i, (q, s) in enumerate(pairs) for k, v in q.derive_metrics(s).items()}


# ---- Allocation strategies (McMahan et al. 2018, Sections 2 and 4) -------------------------------

def per_layer_clips(total_clip, num_groups):
  """S_g = S* / sqrt(m) for each of m groups ("per-layer clipping", Section 2).

  Args:
    total_clip: S* > 0.
    num_groups: m >= 1.

  Returns:
    the list of m clips.

  Raises:
    PrivacyConfigError: S* <= 0 or m < 1.
  """
  validation.check_positive("total_clip", total_clip)
  validation.check_integer("num_groups", num_groups, 1, error=PrivacyConfigError)
  return [total_clip / math.sqrt(num_groups)] * int(num_groups)


def dimension_adjusted_clips(total_clip, dims):
  """S_g = S* * sqrt(d_g / D), D = sum_g d_g (Section 2).

  (The reading for which sum_g S_g^2 = S*^2, the total L2 bound.)

  Args:
    total_clip: S* > 0.
    dims: the group dimensions d_g (positive ints).

  Returns:
    the list of clips S_g.

  Raises:
    PrivacyConfigError: S* <= 0 or a dimension < 1.
  """
  validation.check_positive("total_clip", total_clip)
  dims = [int(d) for d in dims]
  if not dims or min(dims) < 1:
    raise PrivacyConfigError(f"dims must be positive integers, got {dims!r}")
  total = float(sum(dims))
  return [total_clip * math.sqrt(d / total) for d in dims]


def proportional_noise(noise_multiplier, clips):
  """sigma~_g = z * sqrt(G) * S_g (Section 4, proportional noise).

  Group g has noise multiplier z_g = z sqrt(G), so Eq. (1) over the G groups gives z.

  Args:
    noise_multiplier: z >= 0, finite.
    clips: the G clips S_g.

  Returns:
    the list of sigma~_g (`gaussian_query.gaussian_stddev(S_g, z_g)`).

  Raises:
    PrivacyConfigError: a bad z or clip.
  """
  validation.check_nonnegative("noise_multiplier", noise_multiplier, allow_inf=False)
  z_g = noise_multiplier * math.sqrt(len(clips))
  return [gaussian_query.gaussian_stddev(s, z_g) for s in clips]


def dimension_adjusted_noise(noise_multiplier, clips, dims):
  """sigma~_g = z * sqrt(D / d_g) * S_g (Section 4, dimensionality-adjusted noise).

  Group g has noise multiplier z_g = z sqrt(D / d_g), D = sum_g d_g; Eq. (1) gives z.

  Args:
    noise_multiplier: z >= 0, finite.
    clips: the clips S_g.
    dims: the dimensions d_g (same length).

  Returns:
    the list of sigma~_g (`gaussian_query.gaussian_stddev(S_g, z_g)`).

  Raises:
    PrivacyConfigError: a bad z or clip, or lists of different lengths.
  """
  validation.check_nonnegative("noise_multiplier", noise_multiplier, allow_inf=False)
  if len(clips) != len(dims):
    raise PrivacyConfigError(f"clips and dims must have the same length, got {len(clips)} "
                             f"and {len(dims)}")
  total = float(sum(dims))
  return [gaussian_query.gaussian_stddev(s, noise_multiplier * math.sqrt(total / d))
          for s, d in zip(clips, dims)]


def make_nested_gaussian_query(template, total_clip, noise_multiplier, clipping="per_layer",
                               noise_allocation="proportional", denominator=None, seed=None):
  """Builds a per-group Gaussian query over the leaves of `template` (Sections 2 and 4).

  By Eq. (1) the result has effective noise multiplier `noise_multiplier`.

  Args:
    template: a nest of tensors or TensorSpecs (the record's structure and shapes).
    total_clip: S*, the L2 bound of a whole record.
    noise_multiplier: z >= 0, finite.
    clipping: "flat" (one group, S*), "per_layer" (S*/sqrt(m)) or "dimension_adjusted"
      (S* sqrt(d_g/D)).
    noise_allocation: "proportional" or "dimension_adjusted".
    denominator: None (sums), or each group is a GaussianAverageQuery with this denominator.
    seed: fixes the noise (tests only: not private).

  Returns:
    a GaussianSumQuery/NormalizedQuery ("flat") or a NestedQuery shaped like `template`.

  Raises:
    PrivacyConfigError: an unknown clipping or allocation, or a bad clip or z.
  """
  def leaf_query(clip, stddev):
    q = gaussian_query.GaussianSumQuery(clip, stddev, seed=seed)
    return q if denominator is None else normalized_query.NormalizedQuery(q, denominator)

  validation.check_one_of("clipping", clipping, ("flat", "per_layer", "dimension_adjusted"),
                          PrivacyConfigError)
  if clipping == "flat":
    return leaf_query(total_clip, gaussian_query.gaussian_stddev(total_clip, noise_multiplier))
  validation.check_one_of("noise_allocation", noise_allocation,
                          ("proportional", "dimension_adjusted"), PrivacyConfigError)
  leaves = tf.nest.flatten(template)
  dims = [int(np.prod(tf.TensorShape(getattr(t, "shape", np.shape(t))).as_list())) for t in leaves]
  clips = (per_layer_clips(total_clip, len(leaves)) if clipping == "per_layer"
           else dimension_adjusted_clips(total_clip, dims))
  stddevs = (proportional_noise(noise_multiplier, clips) if noise_allocation == "proportional"
             else dimension_adjusted_noise(noise_multiplier, clips, dims))
  queries = [leaf_query(c, s) for c, s in zip(clips, stddevs)]
  return NestedQuery(tf.nest.pack_sequence_as(template, queries))
