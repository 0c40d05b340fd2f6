"""Privacy events of correlated-noise queries (no TensorFlow), in sum units like `events`.

A correlated-noise query's step is not an independent Gaussian sum query: its noise is
C^-1 Z sigma (matrix factorization) or a sum of tree-node noises. The ledger must therefore
know what it was, and accounts it only under a sampling whose analysis covers it (see
`tf_dpiter.accounting.ledger_events`). Fields may be tensors.
"""

import math
from typing import Any, NamedTuple

from tf_dpiter.errors import ParameterValueError


class BandedGaussianEvent(NamedTuple):
  """One step of a banded matrix mechanism (BandMF / banded BLT).

  l2_norm_clip S (per record), stddev sigma of each coordinate of Z, column_norm zeta (the
  largest column norm of the strategy C: the sensitivity of C G for one participation is
  zeta S under add/remove of an example), num_bands b of C. Accounted as a Gaussian of noise
  multiplier sigma / (zeta S) only when participations are >= b steps apart.
  """
  l2_norm_clip: Any
  stddev: Any
  column_norm: Any
  num_bands: int


class TreeGaussianEvent(NamedTuple):
  """One step (leaf) of online tree aggregation (Kairouz et al. 2021, DP-FTRL).

  l2_norm_clip S, stddev sigma of every tree node, tree_size: the most leaves one tree
  holds before it restarts (one participation touches ceil(log2(tree_size + 1)) nodes).
  """
  l2_norm_clip: Any
  stddev: Any
  tree_size: int


class MatrixGaussianEvent(NamedTuple):
  """One step of a (non-banded) matrix mechanism, e.g. BLT, under b-min-separation.

  l2_norm_clip S, stddev sigma per coordinate of Z, equivalent_sensitivity Delta (per unit
  clip): max over p <= k of sens_p / sqrt(p), sens_p the sensitivity of p participations
  >= min_separation apart within the strategy's horizon; min_separation b. Accounted without
  amplification: each example's p participations cost p Gaussians of multiplier
  sigma / (Delta S), which is at least the run's single Gaussian (mu^2 = sens_p^2 / sigma^2).
  """
  l2_norm_clip: Any
  stddev: Any
  equivalent_sensitivity: Any
  min_separation: int


def tree_depth(tree_size):
  """Nodes one leaf touches in an online binary tree of at most `tree_size` leaves:
  ceil(log2(tree_size + 1)) (Kairouz et al. 2021, Appendix D; as dp-accounting computes it).

  Args:
    tree_size: the most leaves one tree holds (an integer >= 1).

  Returns:
    the depth (int).

  Raises:
    ParameterValueError: tree_size not an integer >= 1.
  """
  if isinstance(tree_size, bool) or int(tree_size) != tree_size or tree_size < 1:
    raise ParameterValueError(f"tree_size must be an integer >= 1, got {tree_size!r}")
  return int(math.ceil(math.log2(int(tree_size) + 1)))


def is_correlated_event(x) -> bool:
  """True if `x` is one of this module's events (BandedGaussian, TreeGaussian, MatrixGaussian).

  Args:
    x: any object.

  Returns:
    bool.
  """
  return isinstance(x, (BandedGaussianEvent, TreeGaussianEvent, MatrixGaussianEvent))
