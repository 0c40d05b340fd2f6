"""Privacy events returned by `DPQuery.get_noised_result` (McMahan et al. 2018, Section 6).

Every field is in *sum* units (a query's privacy tuple (S_g, sigma~_g), whatever
post-processing follows); fields may be tensors (an adaptive query's clip).
"""

from typing import Any, NamedTuple


class GaussianSumEvent(NamedTuple):
  """A Gaussian sum query: records clipped to L2 norm `l2_norm_clip`, N(0, stddev^2) noise."""
  l2_norm_clip: Any
  stddev: Any


class LaplaceSumEvent(NamedTuple):
  """A Laplace sum query: records clipped to L1 norm `l1_norm_clip`, Laplace(0, scale) noise.

  Pure epsilon = l1_norm_clip / scale (Dwork & Roth, Thm 3.6).
  """
  l1_norm_clip: Any
  scale: Any


class NonPrivateEvent(NamedTuple):
  """A query that releases data without a guarantee: epsilon = infinity."""


def is_event(x) -> bool:
  """True for the privacy events a ledger records (Gaussian, Laplace, non-private)."""
  return isinstance(x, (GaussianSumEvent, LaplaceSumEvent, NonPrivateEvent))
