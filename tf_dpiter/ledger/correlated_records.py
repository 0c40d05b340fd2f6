"""Ledger rows of correlated-noise steps: banded and BLT matrix mechanisms, tree
aggregation (pure Python and numpy; kinds and policies from the leaf `schema`).

`correlated_requirement` states the sampling a correlated event may be recorded under,
`correlated_row_values` its [kind, clip, noise, sensitivity] row (tensors allowed), and
`correlated_query_row` both, checked. The rules and units of each kind are stated next to the
kinds in `records` (BANDED_GAUSSIAN, TREE_GAUSSIAN, MATRIX_GAUSSIAN).
"""

import numpy as np

from tf_dpiter.ledger.schema import (BANDED_GAUSSIAN, CYCLIC_POISSON, GAUSSIAN, MATRIX_GAUSSIAN,
                                     SHUFFLE, TREE_GAUSSIAN)
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError

def correlated_requirement(event):
  """(policy, least sample_size) a correlated-noise event may be recorded under, from its
  structural fields (Python ints): banded b > 1 -> (cyclic_poisson, b); matrix ->
  (cyclic_poisson, min_separation); tree -> (shuffle, 0); one band -> (None, 0): any policy.

  Raises:
    ParameterValueError: not a correlated event.
  """
  from tf_dpiter.dp_query import correlated_events  # pylint: disable=g-import-not-at-top
  if isinstance(event, correlated_events.BandedGaussianEvent):
    bands = int(event.num_bands)
    return (None, 0) if bands == 1 else (CYCLIC_POISSON, bands)
  if isinstance(event, correlated_events.TreeGaussianEvent):
    return SHUFFLE, 0
  if isinstance(event, correlated_events.MatrixGaussianEvent):
    return CYCLIC_POISSON, int(event.min_separation)
  raise ParameterValueError(f"event must be a BandedGaussianEvent, TreeGaussianEvent or "
                            f"MatrixGaussianEvent, got {event!r}")


def correlated_row_values(event, factor):
  """[kind, clip, noise, sensitivity] of a correlated event; clip, stddev and factor may be
  tensors (for a recorder inside tf.function). Does NOT check the sampling: callers check
  `correlated_requirement` first (see `correlated_query_row`)."""
  from tf_dpiter.dp_query import correlated_events  # pylint: disable=g-import-not-at-top
  clip, stddev = event.l2_norm_clip, event.stddev
  if isinstance(event, correlated_events.BandedGaussianEvent):
    zeta = float(event.column_norm)
    if int(event.num_bands) == 1:   # an independent Gaussian sum query of clip zeta S
      return [GAUSSIAN, clip * zeta, stddev, factor * clip * zeta]
    return [BANDED_GAUSSIAN, clip, stddev, factor * clip * zeta]
  if isinstance(event, correlated_events.TreeGaussianEvent):
    depth = correlated_events.tree_depth(event.tree_size)
    return [TREE_GAUSSIAN, clip, stddev, factor * clip * float(np.sqrt(depth))]
  correlated_requirement(event)     # raises for a non-correlated event
  return [MATRIX_GAUSSIAN, clip, stddev, factor * clip * float(event.equivalent_sensitivity)]


def correlated_query_row(event, policy, sample_size, factor):
  """[kind, clip, noise, sensitivity] of a correlated-noise event, after checking the sample's
  policy and sample_size (Python values) cover it (`correlated_requirement`).

  Banded rows need cyclic_poisson with cycle length b = sample_size >= the bands (Choquette-
  Choo et al. 2023, Theorem 4); matrix (BLT) rows cyclic_poisson with b >= their min
  separation; tree rows shuffle. One band is a plain Gaussian sum query of clip zeta S.

  Raises:
    ParameterValueError: the event's structure is not covered by the sampling.
  """
  needed_policy, least = correlated_requirement(event)
  if needed_policy is not None and (policy != needed_policy or not least <= int(sample_size)):
    raise PrivacyConfigError(
        f"{type(event).__name__} needs policy {needed_policy!r}"
        + (f" with cycle length >= {least} (participations >= {least} steps apart)"
           if needed_policy == CYCLIC_POISSON else " (one participation per pass)")
        + f", got policy {policy!r}, sample_size {sample_size!r}; refusing to record an "
        "unproven guarantee")
  return correlated_row_values(event, factor)
