"""Private hyperparameter selection: a random number of trials (Papernot and Steinke 2022)."""

from tf_dpiter.tuning.random_search import (RandomSearch, SelectionReport, num_trials_distribution,
                                            selection_ledger, selection_report)
from tf_dpiter.tuning.trials import (noisy_count, selection_epsilon, trial_event,
                                     trial_noise_multiplier)

__all__ = ["RandomSearch", "SelectionReport", "num_trials_distribution", "selection_ledger",
           "selection_report", "noisy_count", "selection_epsilon", "trial_event",
           "trial_noise_multiplier"]
