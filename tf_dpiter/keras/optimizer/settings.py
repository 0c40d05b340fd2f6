"""Checks of the DP optimizer settings (McMahan et al. 2018, Section 2: clip S and noise multiplier z).

S: L2 clipping norm per record (loss-gradient units); z: noise stddev over S (the noise on a
clipped sum is N(0, (z S)^2)); M: microbatches per batch; P: examples per physical chunk.
"""

import warnings

from tf_dpiter import dp_query as dp_query_lib
from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError

CLIPPING_MODES = ("auto", "vectorized", "fast")
# The start of the warning for noise_multiplier=0, as a `warnings.filterwarnings` pattern: an
# internal probe that builds a noise-free optimizer on purpose (auditing.check_sensitivity)
# silences exactly this warning, so that it fires only for a user's own configuration.
NO_NOISE_WARNING = r"noise_multiplier=\S+: this DP optimizer adds no noise"


def check_args(l2_norm_clip, noise_multiplier, num_microbatches, dp_query,
               max_physical_batch_size, clipping, ledger_journal=None):
  """Checks a DP optimizer's settings (see DPOptimizerBase.__init__).

  The clip S follows the one rule of `tf_dpiter.validation.check_clip_norm` (the same as
  `GaussianSumQuery`): S > 0, S = +inf only with z = 0.

  Warns:
    UserWarning: noise_multiplier=0 (the optimizer adds no noise: its ledger reports
      epsilon = inf), naming the value and what to do.

  Raises:
    ParameterTypeError: a non-numeric S or z, a non-integer M or P, or a dp_query that is not
      a DPQuery (a TypeError, also a ValueError).
    PrivacyConfigError: S <= 0 or NaN, z < 0, NaN or infinite, S = inf with z > 0 (a
      ValueError).
    ParameterValueError: M or P < 1, an unknown clipping mode, dp_query given with (S, z), or
      neither given, a ledger_journal that is not a non-empty path string.
  """
  if dp_query is not None:
    validation.check_instance("dp_query", dp_query, dp_query_lib.DPQuery, "a tf_dpiter DPQuery")
    if l2_norm_clip is not None or noise_multiplier is not None:
      raise ParameterValueError(
          "give either `dp_query` or (`l2_norm_clip`, `noise_multiplier`), not both. Received: "
          f"l2_norm_clip={l2_norm_clip!r}, noise_multiplier={noise_multiplier!r}")
  else:
    if l2_norm_clip is None or noise_multiplier is None:
      raise ParameterValueError(
          "`l2_norm_clip` and `noise_multiplier` are required without `dp_query`. Received: "
          f"l2_norm_clip={l2_norm_clip!r}, noise_multiplier={noise_multiplier!r}")
    z = float(validation.check_noise_multiplier("noise_multiplier", noise_multiplier))
    validation.check_clip_norm("l2_norm_clip", l2_norm_clip, noise_multiplier=z)
    if z == 0:
      warnings.warn(
          f"noise_multiplier={noise_multiplier!r}: this DP optimizer adds no noise, so its "
          "training is NOT differentially private (the ledger reports epsilon = inf). Use "
          "noise_multiplier > 0 (about 1.0 is usual), or from_budget(epsilon, delta, ...) / "
          "make_private_with_epsilon to calibrate it; noise 0 is for tests only",
          UserWarning, stacklevel=3)
  validation.check_optional_integer("num_microbatches", num_microbatches, 1)
  validation.check_optional_integer("max_physical_batch_size", max_physical_batch_size, 1)
  validation.check_one_of("clipping", clipping, CLIPPING_MODES)
  if ledger_journal is not None and (not isinstance(ledger_journal, str) or not ledger_journal):
    raise ParameterValueError(
        f"`ledger_journal` must be None or a file path. Received: ledger_journal={ledger_journal!r}")
