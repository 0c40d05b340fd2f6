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
_MODULES = {   # module -> its public names (dp_query first: the others import it)
    "dp_query": ("DPQuery", "SumAggregationDPQuery", "clip_by_global_l2_norm", "clip_factors",
                 "gives_clip_factors", "global_l2_norm"),
    "automatic_clipping": ("AutomaticClippingSumQuery",),
    "band_mf_query": ("BandMFQuery", "CorrelatedNoiseQuery"),
    "tree_aggregation_query": ("TreeAggregationQuery",),
    "blt_query": ("BLTQuery",),
    "correlated_events": ("BandedGaussianEvent", "TreeGaussianEvent", "MatrixGaussianEvent"),
    "events": ("GaussianSumEvent", "LaplaceSumEvent", "NonPrivateEvent"),
    "gaussian_query": ("GaussianSumQuery", "gaussian_stddev"),
    "joint_clip_query": ("JointClipQuery",),
    "laplace_query": ("LaplaceSumQuery", "clip_by_l1_norm", "laplace_noise"),
    "nested_query": ("NestedQuery", "dimension_adjusted_clips", "dimension_adjusted_noise",
                     "make_nested_gaussian_query", "per_layer_clips", "proportional_noise"),
    "no_privacy_query": ("NoPrivacyAverageQuery", "NoPrivacySumQuery"),
    "normalized_query": ("GaussianAverageQuery", "NormalizedQuery"),
    "quantile_queries": ("QuantileAdaptiveClipSumQuery", "QuantileEstimatorQuery",
                         "value_noise_multiplier"),
    "randomness": ("NotPrivateSeedWarning", "make_generator"),
    "serialization": ("deserialize", "register_query", "serialize"),
}
_EXPORTS = {name: f"tf_dpiter.dp_query.{module}" for module, names in _MODULES.items()
            for name in names}
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
