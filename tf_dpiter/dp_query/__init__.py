"""Privacy mechanisms: DPQuery objects that clip records and add noise (seed 002, Sections 1-4, 7)."""

import importlib

# Loaded on first use: `tf_dpiter.dp_query.events` and `.validation` stay free of TensorFlow,
# so the accountant imports them without paying for TF.
_EXPORTS = {
    'DPQuery': 'tf_dpiter.dp_query.dp_query',
    'SumAggregationDPQuery': 'tf_dpiter.dp_query.dp_query',
    'clip_by_global_l2_norm': 'tf_dpiter.dp_query.dp_query',
    'global_l2_norm': 'tf_dpiter.dp_query.dp_query',
    'GaussianSumEvent': 'tf_dpiter.dp_query.events',
    'LaplaceSumEvent': 'tf_dpiter.dp_query.events',
    'NonPrivateEvent': 'tf_dpiter.dp_query.events',
    'GaussianSumQuery': 'tf_dpiter.dp_query.gaussian_query',
    'JointClipQuery': 'tf_dpiter.dp_query.joint_clip_query',
    'LaplaceSumQuery': 'tf_dpiter.dp_query.laplace_query',
    'clip_by_l1_norm': 'tf_dpiter.dp_query.laplace_query',
    'laplace_noise': 'tf_dpiter.dp_query.laplace_query',
    'NestedQuery': 'tf_dpiter.dp_query.nested_query',
    'dimension_adjusted_clips': 'tf_dpiter.dp_query.nested_query',
    'dimension_adjusted_noise': 'tf_dpiter.dp_query.nested_query',
    'effective_noise_multiplier': 'tf_dpiter.dp_query.nested_query',
    'make_nested_gaussian_query': 'tf_dpiter.dp_query.nested_query',
    'per_layer_clips': 'tf_dpiter.dp_query.nested_query',
    'proportional_noise': 'tf_dpiter.dp_query.nested_query',
    'NoPrivacyAverageQuery': 'tf_dpiter.dp_query.no_privacy_query',
    'NoPrivacySumQuery': 'tf_dpiter.dp_query.no_privacy_query',
    'GaussianAverageQuery': 'tf_dpiter.dp_query.normalized_query',
    'NormalizedQuery': 'tf_dpiter.dp_query.normalized_query',
    'QuantileAdaptiveClipSumQuery': 'tf_dpiter.dp_query.quantile_queries',
    'QuantileEstimatorQuery': 'tf_dpiter.dp_query.quantile_queries',
    'value_noise_multiplier': 'tf_dpiter.dp_query.quantile_queries',
    'NotPrivateSeedWarning': 'tf_dpiter.dp_query.randomness',
    'make_generator': 'tf_dpiter.dp_query.randomness',
    'deserialize': 'tf_dpiter.dp_query.serialization',
    'register_query': 'tf_dpiter.dp_query.serialization',
    'serialize': 'tf_dpiter.dp_query.serialization',
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    # Load every module at once: importing them registers the queries for deserialize().
    for export, module in _EXPORTS.items():
      globals()[export] = getattr(importlib.import_module(module), export)
    return globals()[name]
  raise AttributeError(f"module 'tf_dpiter.dp_query' has no attribute {name!r}")
