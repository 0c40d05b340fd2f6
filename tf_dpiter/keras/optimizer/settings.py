"""Checks of the DP optimizer settings (McMahan et al. 2018, Section 2: clip S and noise multiplier z).

S: L2 clipping norm per record (loss-gradient units); z: noise stddev over S (the noise on a
clipped sum is N(0, (z S)^2)); M: microbatches per batch; P: examples per physical chunk.
The checks themselves are those of the plan and the flags (`dp_config.DPConfig`,
`dp_config.PerformanceFlags`), validated once when they are made; here: the ledger journal's.
"""

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.keras.optimizer import dp_config

CLIPPING_MODES = dp_config.CLIPPING_MODES
# The start of the warning for noise_multiplier=0, as a `warnings.filterwarnings` pattern: an
# internal probe that builds a noise-free optimizer on purpose (auditing.check_sensitivity)
# silences exactly this warning, so that it fires only for a user's own configuration.
NO_NOISE_WARNING = r"noise_multiplier=\S+: this DP optimizer adds no noise"


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
