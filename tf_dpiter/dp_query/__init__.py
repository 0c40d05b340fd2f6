"""Privacy mechanisms: DPQuery objects that clip records and add noise (McMahan et al., "A
General Approach to Adding Differential Privacy to Iterative Training Procedures", Sections
1-4, 7): the interface and the per-record L2 clip, Gaussian, adaptive, automatic-clipping,
Laplace and correlated-noise (BandMF, BLT, tree) queries, their privacy events (sum units),
the noise generator and serialization. The implementation modules are not part of the API.
"""

import importlib

from tf_dpiter.errors import ParameterTypeError as _ParameterTypeError
from tf_dpiter.errors import ParameterValueError as _ParameterValueError

# Loaded on first use: `tf_dpiter.dp_query.events` (and `tf_dpiter.validation`) stay free of TensorFlow,
# so the accountant imports them without paying for TF.
_EXPORTS = {
    'DPQuery': 'tf_dpiter.dp_query.dp_query',
    'AutomaticClippingSumQuery': 'tf_dpiter.dp_query.automatic_clipping',
    'BandMFQuery': 'tf_dpiter.dp_query.band_mf_query',
    'CorrelatedNoiseQuery': 'tf_dpiter.dp_query.band_mf_query',
    'TreeAggregationQuery': 'tf_dpiter.dp_query.tree_aggregation_query',
    'BLTQuery': 'tf_dpiter.dp_query.blt_query',
    'BandedGaussianEvent': 'tf_dpiter.dp_query.correlated_events',
    'TreeGaussianEvent': 'tf_dpiter.dp_query.correlated_events',
    'MatrixGaussianEvent': 'tf_dpiter.dp_query.correlated_events',
    'SumAggregationDPQuery': 'tf_dpiter.dp_query.dp_query',
    'clip_by_global_l2_norm': 'tf_dpiter.dp_query.dp_query',
    'clip_factors': 'tf_dpiter.dp_query.dp_query',
    'gives_clip_factors': 'tf_dpiter.dp_query.dp_query',
    'global_l2_norm': 'tf_dpiter.dp_query.dp_query',
    'GaussianSumEvent': 'tf_dpiter.dp_query.events',
    'LaplaceSumEvent': 'tf_dpiter.dp_query.events',
    'NonPrivateEvent': 'tf_dpiter.dp_query.events',
    'GaussianSumQuery': 'tf_dpiter.dp_query.gaussian_query',
    'gaussian_stddev': 'tf_dpiter.dp_query.gaussian_query',
    'JointClipQuery': 'tf_dpiter.dp_query.joint_clip_query',
    'LaplaceSumQuery': 'tf_dpiter.dp_query.laplace_query',
    'clip_by_l1_norm': 'tf_dpiter.dp_query.laplace_query',
    'laplace_noise': 'tf_dpiter.dp_query.laplace_query',
    'NestedQuery': 'tf_dpiter.dp_query.nested_query',
    'dimension_adjusted_clips': 'tf_dpiter.dp_query.nested_query',
    'dimension_adjusted_noise': 'tf_dpiter.dp_query.nested_query',
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
__all__ = sorted(list(_EXPORTS) + ['declare_query_module', 'declared_query_module'])

# Query classes defined in the layers above dp_query, by registered name -> the module that
# registers them. Filled by those layers (through the package root), never by dp_query itself.
_DECLARED_QUERY_MODULES = {}


def declare_query_module(name, module):
  """Declares that the DPQuery registered as `name` is defined in `module` (which
  `deserialize` imports on demand).

  Args:
    name: the registered name (a non-empty str).
    module: the dotted module path whose import registers the class (a non-empty str).

  Raises:
    ParameterTypeError: a name or module that is not a non-empty string.
    ParameterValueError: `name` is already declared for another module.
  """
  for arg, value in (("name", name), ("module", module)):
    if not isinstance(value, str) or not value:
      raise _ParameterTypeError(f"{arg} must be a non-empty string, got {value!r}")
  old = _DECLARED_QUERY_MODULES.get(name)
  if old is not None and old != module:
    raise _ParameterValueError(f"the DPQuery name {name!r} is already declared in module {old!r}, "
                               f"got {module!r}")
  _DECLARED_QUERY_MODULES[name] = module


def declared_query_module(name):
  """The module declared for the DPQuery name `name` (`declare_query_module`).

  Args:
    name: a registered DPQuery name.

  Returns:
    the dotted module path, or None when nothing is declared.
  """
  return _DECLARED_QUERY_MODULES.get(name)


def __getattr__(name):
  if name in _EXPORTS:
    # Load every module at once: importing them registers the queries for deserialize().
    for export, module in _EXPORTS.items():
      globals()[export] = getattr(importlib.import_module(module), export)
    return globals()[name]
  raise AttributeError(f"module 'tf_dpiter.dp_query' has no attribute {name!r}")


def __dir__():
  return list(__all__)
