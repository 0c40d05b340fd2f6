"""Accounting: the ledger read by dp-accounting's RDP or PLD accountant (McMahan et al. 2018, Sections 3-6).

Also: a GDP accountant (an approximation, as TF Privacy's), epsilon over steps
(`epsilon_curve`), the budget look-ahead (`epsilon_after`, `delta_after`, `StepBudget`;
module `lookahead`), calibration (`calibrate_*`) and TF Privacy's
`compute_dp_sgd_privacy_statement`. Accountants are looked up by name in a registry
(`register_accountant`, module `accountants`).
"""

from tf_dpiter.accounting.accountant import (
    ACCOUNTANTS, LedgerContent, REPORT_ACCOUNTANTS, PrivacyReport, check_accountant, delta, epsilon,
    ledger_to_dp_event, make_accountant, optimal_rdp_order, privacy_report, report_from_groups,
    shuffle_passes_needed)
from tf_dpiter.accounting.accountants import (
    RegisteredAccountant, accountant_names, register_accountant, unregister_accountant)
from tf_dpiter.accounting.calibration import (
    calibrate_noise_multiplier, calibrate_sampling_probability, calibrate_steps,
    compute_noise_from_budget)
from tf_dpiter.accounting.curve import EpsilonCurve, epsilon_curve, plot_epsilon_curve
from tf_dpiter.accounting.dp_sgd import DpSgdPrivacy, compute_dp_sgd_privacy, dp_sgd_steps
from tf_dpiter.accounting.ledger_events import SampleGroup, effective_noise_multiplier
from tf_dpiter.accounting.statement import compute_dp_sgd_privacy_statement
from tf_dpiter.accounting.lookahead import PlannedSample, StepBudget, delta_after, epsilon_after
from tf_dpiter.accounting.planning import BatchPlan, plan_batch_size

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
