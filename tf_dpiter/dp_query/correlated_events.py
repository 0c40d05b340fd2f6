"""Privacy events of correlated-noise queries, in sum units like `events`; the ledger accounts
them only under a sampling whose analysis covers them (`accounting.ledger_events`).
"""

import math
from typing import Any, NamedTuple

from tf_dpiter.errors import ParameterValueError


class BandedGaussianEvent(NamedTuple):
  """One step of a banded matrix mechanism (BandMF / banded BLT).

  Fields: clip S, stddev sigma per coordinate of Z, column_norm zeta (C's largest column
  norm), num_bands b. A Gaussian of multiplier sigma / (zeta S) under b-min-separation.
  """
  l2_norm_clip: Any
  stddev: Any
  column_norm: Any
  num_bands: int


class TreeGaussianEvent(NamedTuple):
  """One step (leaf) of online tree aggregation (Kairouz et al. 2021, DP-FTRL).

  Fields: clip S, stddev sigma per node, tree_size (leaves of one tree).
  """
  l2_norm_clip: Any
  stddev: Any
  tree_size: int


class MatrixGaussianEvent(NamedTuple):
  """One step of a (non-banded) matrix mechanism, e.g. BLT, under b-min-separation.

  Fields: clip S, stddev sigma, equivalent_sensitivity Delta = max_p sens_p / sqrt(p) (per
  unit clip), min_separation b. Each participation costs a Gaussian of sigma / (Delta S).
  """
  l2_norm_clip: Any
  stddev: Any
  equivalent_sensitivity: Any
  min_separation: int


def tree_depth(tree_size):
  """Nodes one leaf touches in an online binary tree of at most `tree_size` leaves:
  ceil(log2(tree_size + 1)), an int (Kairouz et al. 2021, Appendix D; as dp-accounting
  computes it).

  Raises:
    ParameterValueError: tree_size not an integer >= 1.
  """
  if isinstance(tree_size, bool) or int(tree_size) != tree_size or tree_size < 1:
    raise ParameterValueError(f"tree_size must be an integer >= 1, got {tree_size!r}")
  return int(math.ceil(math.log2(int(tree_size) + 1)))


def is_correlated_event(x) -> bool:
  """True if `x` is one of this module's events (BandedGaussian, TreeGaussian, MatrixGaussian)."""
  return isinstance(x, (BandedGaussianEvent, TreeGaussianEvent, MatrixGaussianEvent))
