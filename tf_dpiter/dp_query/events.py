"""Privacy events returned by `DPQuery.get_noised_result` (McMahan et al. 2018, Section 6).

Every field is in *sum* units: a Gaussian sum query with privacy tuple
(S_g, sigma~_g) reports `GaussianSumEvent(l2_norm_clip=S_g, stddev=sigma~_g)`, whatever
post-processing (averaging, rescaling) the query applies afterwards. Fields may be
tensors, so that adaptive queries can report the clip they actually used.
"""

import math
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


def effective_noise_multiplier(clips, stddevs):
  """The noise multiplier of one sample's Gaussian queries taken together (McMahan et al. 2018, Eq. (1)).

  z = (sum_g (S_g / sigma~_g)^2)^(-1/2): the groups g of a sample (per-layer clipping,
  Section 2) cost as much as one Gaussian query of noise multiplier z. Groups with S_g = 0
  cost nothing; S_g > 0 with sigma~_g = 0 gives z = 0 (no privacy); no costly group gives
  z = inf.

  Args:
    clips: the sensitivities S_g (clips, or clips times the relation's factor).
    stddevs: the noise standard deviations sigma~_g, same length.

  Returns:
    z, a float in [0, inf].
  """
  inv = 0.0
  for s, sd in zip(clips, stddevs):
    if s == 0:
      continue
    if sd == 0:
      return 0.0
    inv += (s / sd) ** 2
  return math.inf if inv == 0 else inv ** -0.5



def is_event(x) -> bool:
  """True for the privacy events a ledger records (Gaussian, Laplace, non-private).

  Args:
    x: any object.

  Returns:
    bool.
  """
  return isinstance(x, (GaussianSumEvent, LaplaceSumEvent, NonPrivateEvent))
