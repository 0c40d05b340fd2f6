"""Accounting: the ledger read by dp-accounting's RDP or PLD accountant (McMahan et al. 2018, Sections 3-6).

Also: a GDP accountant (an approximation, as TF Privacy's), epsilon over steps
(`epsilon_curve`), the budget look-ahead (`epsilon_after`, `delta_after`, `StepBudget`;
module `lookahead`), calibration (`calibrate_*`) and TF Privacy's
`compute_dp_sgd_privacy_statement`. Accountants are looked up by name in a registry
(`register_accountant`, module `accountants`).
"""

from tf_dpiter.accounting.accountant import ACCOUNTANTS
from tf_dpiter.accounting.accountant import LedgerContent
from tf_dpiter.accounting.accountant import REPORT_ACCOUNTANTS
from tf_dpiter.accounting.accountant import PrivacyReport
from tf_dpiter.accounting.accountant import check_accountant
from tf_dpiter.accounting.accountant import delta
from tf_dpiter.accounting.accountant import epsilon
from tf_dpiter.accounting.accountant import ledger_to_dp_event
from tf_dpiter.accounting.accountant import make_accountant
from tf_dpiter.accounting.accountant import optimal_rdp_order
from tf_dpiter.accounting.accountant import privacy_report
from tf_dpiter.accounting.accountant import report_from_groups
from tf_dpiter.accounting.accountant import shuffle_passes_needed
from tf_dpiter.accounting.accountants import RegisteredAccountant
from tf_dpiter.accounting.accountants import accountant_names
from tf_dpiter.accounting.accountants import register_accountant
from tf_dpiter.accounting.accountants import unregister_accountant
from tf_dpiter.accounting.calibration import calibrate_noise_multiplier
from tf_dpiter.accounting.calibration import calibrate_sampling_probability
from tf_dpiter.accounting.calibration import calibrate_steps
from tf_dpiter.accounting.calibration import compute_noise_from_budget
from tf_dpiter.accounting.curve import EpsilonCurve
from tf_dpiter.accounting.curve import epsilon_curve
from tf_dpiter.accounting.curve import plot_epsilon_curve
from tf_dpiter.accounting.dp_sgd import DpSgdPrivacy
from tf_dpiter.accounting.dp_sgd import compute_dp_sgd_privacy
from tf_dpiter.accounting.dp_sgd import dp_sgd_steps
from tf_dpiter.accounting.ledger_events import SampleGroup
from tf_dpiter.accounting.ledger_events import effective_noise_multiplier
from tf_dpiter.accounting.statement import compute_dp_sgd_privacy_statement
from tf_dpiter.accounting.lookahead import PlannedSample
from tf_dpiter.accounting.lookahead import StepBudget
from tf_dpiter.accounting.lookahead import delta_after
from tf_dpiter.accounting.lookahead import epsilon_after
from tf_dpiter.accounting.planning import BatchPlan
from tf_dpiter.accounting.planning import plan_batch_size

__all__ = [
    "ACCOUNTANTS", "BatchPlan", "DpSgdPrivacy", "EpsilonCurve", "LedgerContent", "PlannedSample",
    "PrivacyReport", "REPORT_ACCOUNTANTS", "RegisteredAccountant", "SampleGroup", "StepBudget",
    "accountant_names", "calibrate_noise_multiplier",
    "calibrate_sampling_probability", "calibrate_steps", "check_accountant",
    "compute_dp_sgd_privacy", "compute_dp_sgd_privacy_statement", "compute_noise_from_budget",
    "delta", "delta_after", "dp_sgd_steps", "effective_noise_multiplier", "epsilon",
    "epsilon_after", "epsilon_curve", "ledger_to_dp_event", "make_accountant",
    "optimal_rdp_order", "plan_batch_size", "plot_epsilon_curve", "privacy_report",
    "register_accountant", "report_from_groups", "shuffle_passes_needed", "unregister_accountant",
]
