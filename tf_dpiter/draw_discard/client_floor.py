"""The client's privacy floor for Draw and Discard (Pihur et al. 2018, Section IV): before
training, the served spec must have epsilon <= `max_epsilon` (default ln 32), noise std >=
`min_noise` times the sensitivity 2 gamma clip, a known noise law, (Gaussian) delta <=
`max_delta` and, when set, p epsilon <= `max_total_epsilon` (p weights: the epsilon is per
weight, each clipped and noised on its own, so a record that moves all p weights costs up to
p epsilon per update, by basic composition; a server serving many columns copying one
attribute spends that); else PrivacyFloorError and nothing is sent.
"""

from __future__ import annotations

import dataclasses
import math

from tf_dpiter import validation
from tf_dpiter.draw_discard import calibration
from tf_dpiter.draw_discard import glm

PAPER_EPSILON = math.log(32)


class PrivacyFloorError(ValueError):
  """The served spec is weaker than the client's privacy floor; nothing was sent."""


@dataclasses.dataclass(frozen=True)
class PrivacyFloor:
  """What a client requires of a served spec before it trains on its records.

  Attributes:
    max_epsilon: largest per-update epsilon accepted; None disables the whole floor
      (explicitly non-private use, e.g. the paper's noiseless experiments).
    min_noise: smallest noise std per weight, in units of the sensitivity 2*gamma*clip
      (Laplace at epsilon has sqrt(2)/epsilon); None: no extra requirement.
    max_delta: largest delta accepted for Gaussian noise.
    max_total_epsilon: largest p epsilon accepted (p: the spec's weights; a record's epsilon
      per update when it moves every weight); None: no bound on it.
  """
  max_epsilon: float | None = PAPER_EPSILON
  min_noise: float | None = None
  max_delta: float = 1e-5
  max_total_epsilon: float | None = None

  def __post_init__(self):
    if self.max_epsilon is not None:
      validation.check_positive("max_epsilon", self.max_epsilon, allow_inf=True)
    if self.min_noise is not None:
      validation.check_positive("min_noise", self.min_noise, allow_inf=True)
    validation.check_delta("max_delta", self.max_delta)
    if self.max_total_epsilon is not None:
      validation.check_positive("max_total_epsilon", self.max_total_epsilon)

  def check(self, spec: glm.ModelSpec) -> None:
    """Raises PrivacyFloorError if the served spec is weaker than this floor.

    Raises:
      PrivacyFloorError: naming the setting and both values.
    """
    if self.max_epsilon is None:
      return
    if spec.epsilon is None or spec.noise == "none":
      raise PrivacyFloorError(f"served spec has no noise (epsilon={spec.epsilon!r}, "
                              f"noise={spec.noise!r}); client floor max_epsilon={self.max_epsilon:g}")
    if not (isinstance(spec.epsilon, (int, float)) and math.isfinite(spec.epsilon)
            and 0 < spec.epsilon <= self.max_epsilon):
      raise PrivacyFloorError(f"served epsilon={spec.epsilon!r} exceeds the client's "
                              f"max_epsilon={self.max_epsilon:g}")
    if spec.noise == "gaussian" and not spec.delta <= self.max_delta:
      raise PrivacyFloorError(f"served delta={spec.delta!r} exceeds the client's "
                              f"max_delta={self.max_delta:g}")
    if (self.max_total_epsilon is not None
        and spec.num_weights * spec.epsilon > self.max_total_epsilon):
      raise PrivacyFloorError(
          f"served spec has {spec.num_weights} weights at epsilon={spec.epsilon:g} each: a "
          f"record moving every weight costs up to {spec.num_weights * spec.epsilon:g} per "
          f"update, over the client's max_total_epsilon={self.max_total_epsilon:g}")
    if self.min_noise is not None:
      std = calibration.noise_std(spec.noise, spec.gamma, spec.epsilon, spec.clip, spec.delta)
      ratio = std / calibration.sensitivity(spec.gamma, spec.clip)
      if ratio < self.min_noise:
        raise PrivacyFloorError(f"served noise std is {ratio:.4g} x the sensitivity; the "
                                f"client's min_noise is {self.min_noise:g}")
