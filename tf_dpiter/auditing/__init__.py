"""Empirical privacy auditing: ε lower bounds from attacks and canaries that test our claims.

Sound (ε, δ) lower bounds from member and non-member scores (`bounds`) and from one run
(`one_run`, Steinke, Nasr & Jagielski 2023); attacks (`attacks`: loss, LiRA); TF Privacy-style
membership inference (`membership_inference`, `mia_results`, `mia_plotting`); a sensitivity
check of a DP model's clipped sum (`sensitivity`); white-box Dirac gradient canaries inside
the real DP-SGD step (`canaries`, `whitebox`, `run_whitebox_audit`, `AuditCallback`).
"""

from tf_dpiter.auditing import attacks
from tf_dpiter.auditing import bounds
from tf_dpiter.auditing import canaries
from tf_dpiter.auditing import membership_inference
from tf_dpiter.auditing import mia_plotting
from tf_dpiter.auditing import mia_results
from tf_dpiter.auditing import one_run
from tf_dpiter.auditing import report
from tf_dpiter.auditing import sensitivity
from tf_dpiter.auditing import whitebox
from tf_dpiter.auditing.attacks import attack_metrics
from tf_dpiter.auditing.attacks import auc
from tf_dpiter.auditing.attacks import lira_leave_one_out
from tf_dpiter.auditing.attacks import lira_scores
from tf_dpiter.auditing.attacks import logit_confidence
from tf_dpiter.auditing.attacks import loss_scores
from tf_dpiter.auditing.attacks import roc_curve
from tf_dpiter.auditing.attacks import shadow_confidences
from tf_dpiter.auditing.attacks import tpr_at_fpr
from tf_dpiter.auditing.bounds import LowerBound
from tf_dpiter.auditing.bounds import clopper_pearson
from tf_dpiter.auditing.bounds import epsilon_lower_bound
from tf_dpiter.auditing.bounds import gdp_epsilon
from tf_dpiter.auditing.bounds import lower_bound
from tf_dpiter.auditing.callback import AuditCallback
from tf_dpiter.auditing.canaries import DiracCanaryLoss
from tf_dpiter.auditing.canaries import DiracCanaryModel
from tf_dpiter.auditing.experiment import WhiteBoxResult
from tf_dpiter.auditing.experiment import run_whitebox_audit
from tf_dpiter.auditing.membership_inference import AttackInputData
from tf_dpiter.auditing.membership_inference import SlicingSpec
from tf_dpiter.auditing.membership_inference import run_attacks
from tf_dpiter.auditing.mia_plotting import plot_by_epochs
from tf_dpiter.auditing.mia_plotting import plot_privacy_vs_accuracy
from tf_dpiter.auditing.mia_plotting import plot_roc_curve
from tf_dpiter.auditing.mia_plotting import save_plot
from tf_dpiter.auditing.mia_results import AttackResults
from tf_dpiter.auditing.mia_results import AttackResultsCollection
from tf_dpiter.auditing.mia_results import AttackType
from tf_dpiter.auditing.mia_results import PrivacyMetric
from tf_dpiter.auditing.mia_results import PrivacyReportMetadata
from tf_dpiter.auditing.mia_results import SingleAttackResult
from tf_dpiter.auditing.one_run import one_run_epsilon_lower_bound
from tf_dpiter.auditing.sensitivity import SensitivityReport
from tf_dpiter.auditing.sensitivity import check_sensitivity
from tf_dpiter.auditing.report import plot_privacy_report
from tf_dpiter.auditing.whitebox import CanaryRecorder
from tf_dpiter.auditing.whitebox import canary_scores
from tf_dpiter.auditing.whitebox import claimed_epsilon
from tf_dpiter.auditing.whitebox import whitebox_lower_bound

__all__ = [
    "AttackInputData",
    "AttackResults",
    "AttackResultsCollection",
    "AttackType",
    "AuditCallback",
    "CanaryRecorder",
    "DiracCanaryLoss",
    "DiracCanaryModel",
    "LowerBound",
    "PrivacyMetric",
    "PrivacyReportMetadata",
    "SensitivityReport",
    "SingleAttackResult",
    "SlicingSpec",
    "WhiteBoxResult",
    "attack_metrics",
    "auc",
    "canary_scores",
    "check_sensitivity",
    "claimed_epsilon",
    "clopper_pearson",
    "epsilon_lower_bound",
    "gdp_epsilon",
    "lira_leave_one_out",
    "lira_scores",
    "logit_confidence",
    "loss_scores",
    "lower_bound",
    "one_run_epsilon_lower_bound",
    "plot_by_epochs",
    "plot_privacy_report",
    "plot_privacy_vs_accuracy",
    "plot_roc_curve",
    "roc_curve",
    "run_attacks",
    "run_whitebox_audit",
    "save_plot",
    "shadow_confidences",
    "tpr_at_fpr",
    "whitebox_lower_bound",
]
