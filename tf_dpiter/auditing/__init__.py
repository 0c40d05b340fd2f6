"""Empirical privacy auditing: ε lower bounds from attacks and canaries that test our claims.

Sound (ε, δ) lower bounds from member and non-member scores (`bounds`) and from one run
(`one_run`, Steinke, Nasr & Jagielski 2023); attacks (`attacks`: loss, LiRA); TF Privacy-style
membership inference (`membership_inference`, `mia_results`, `mia_plotting`); a sensitivity
check of a DP model's clipped sum (`sensitivity`); white-box Dirac gradient canaries inside
the real DP-SGD step (`canaries`, `whitebox`, `run_whitebox_audit`, `AuditCallback`).
"""

from tf_dpiter.auditing import (
    attacks, bounds, canaries, membership_inference, mia_plotting, mia_results, one_run, report,
    sensitivity, whitebox)
from tf_dpiter.auditing.attacks import (
    attack_metrics, auc, lira_leave_one_out, lira_scores, logit_confidence, loss_scores, roc_curve,
    shadow_confidences, tpr_at_fpr)
from tf_dpiter.auditing.bounds import (
    LowerBound, clopper_pearson, epsilon_lower_bound, gdp_epsilon, lower_bound)
from tf_dpiter.auditing.callback import AuditCallback
from tf_dpiter.auditing.canaries import DiracCanaryLoss, DiracCanaryModel
from tf_dpiter.auditing.experiment import WhiteBoxResult, run_whitebox_audit
from tf_dpiter.auditing.membership_inference import AttackInputData, SlicingSpec, run_attacks
from tf_dpiter.auditing.mia_plotting import (
    plot_by_epochs, plot_privacy_vs_accuracy, plot_roc_curve, save_plot)
from tf_dpiter.auditing.mia_results import (
    AttackResults, AttackResultsCollection, AttackType, PrivacyMetric, PrivacyReportMetadata,
    SingleAttackResult)
from tf_dpiter.auditing.one_run import one_run_epsilon_lower_bound
from tf_dpiter.auditing.sensitivity import SensitivityReport, check_sensitivity
from tf_dpiter.auditing.report import plot_privacy_report
from tf_dpiter.auditing.whitebox import (
    CanaryRecorder, canary_scores, claimed_epsilon, whitebox_lower_bound)

__all__ = [
    "AttackInputData", "AttackResults", "AttackResultsCollection", "AttackType", "AuditCallback",
    "CanaryRecorder", "DiracCanaryLoss", "DiracCanaryModel", "LowerBound", "PrivacyMetric",
    "PrivacyReportMetadata", "SensitivityReport", "SingleAttackResult", "SlicingSpec",
    "WhiteBoxResult", "attack_metrics", "auc", "canary_scores", "check_sensitivity",
    "claimed_epsilon", "clopper_pearson", "epsilon_lower_bound", "gdp_epsilon",
    "lira_leave_one_out", "lira_scores", "logit_confidence", "loss_scores", "lower_bound",
    "one_run_epsilon_lower_bound", "plot_by_epochs", "plot_privacy_report",
    "plot_privacy_vs_accuracy", "plot_roc_curve", "roc_curve", "run_attacks", "run_whitebox_audit",
    "save_plot", "shadow_confidences", "tpr_at_fpr", "whitebox_lower_bound"
]
