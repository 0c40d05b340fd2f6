"""Checks of the DP optimizer settings (McMahan et al. 2018, Section 2: clip S and noise multiplier z).

S: L2 clipping norm per record (loss-gradient units); z: noise stddev over S (the noise on a
clipped sum is N(0, (z S)^2)); M: microbatches per batch; P: examples per physical chunk.
The checks themselves are those of the plan and the flags (`dp_config.DPConfig`,
`dp_config.PerformanceFlags`), validated once when they are made; `check_args` runs them.
"""

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras.optimizer import dp_config

CLIPPING_MODES = dp_config.CLIPPING_MODES
# The start of the warning for noise_multiplier=0, as a `warnings.filterwarnings` pattern: an
# internal probe that builds a noise-free optimizer on purpose (auditing.check_sensitivity)
# silences exactly this warning, so that it fires only for a user's own configuration.
NO_NOISE_WARNING = r"noise_multiplier=\S+: this DP optimizer adds no noise"


def check_args(l2_norm_clip, noise_multiplier, num_microbatches, dp_query,
               max_physical_batch_size, clipping, ledger_journal=None):
  """Checks a DP optimizer's settings (see DPOptimizerBase.__init__) as its plan and flags do.

  Args:
    l2_norm_clip: S, or None with a dp_query.
    noise_multiplier: z, or None with a dp_query.
    num_microbatches: M, or None.
    dp_query: a custom DPQuery, or None.
    max_physical_batch_size: P, or None.
    clipping: "auto" | "vectorized" | "fast".
    ledger_journal: None or a file path.

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
  dp_config.DPConfig(l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
                     num_microbatches=num_microbatches, dp_query=dp_query)
  dp_config.PerformanceFlags(max_physical_batch_size=max_physical_batch_size, clipping=clipping)
  check_ledger_journal(ledger_journal)


def check_ledger_journal(ledger_journal):
  """Checks the optimizer's ledger journal path.

  Args:
    ledger_journal: None or a non-empty file path string.
  Raises:
    ParameterValueError: anything else, named with its value.
  """
  if ledger_journal is not None and (not isinstance(ledger_journal, str) or not ledger_journal):
    raise ParameterValueError(validation.message("ledger_journal", "None or a file path",
                                                 ledger_journal))
