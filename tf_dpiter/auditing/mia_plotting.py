"""Figures of membership-inference results (TF Privacy's `plotting` and `privacy_report`).

`plot_by_epochs` and `plot_privacy_vs_accuracy` draw one panel per `PrivacyMetric` of the
entire-dataset slice, one line per model variant and attack, and, where every point carries
a `PrivacyBound`, the bound (epsilon, delta)-DP puts on it (black, dashed). The figures are
matplotlib's (`pip install "tf_dpiter[plot]"`); no backend is chosen here.
"""

from tf_dpiter import validation
from tf_dpiter.auditing.mia_results import AttackResults
from tf_dpiter.auditing.mia_results import AttackResultsCollection
from tf_dpiter.auditing.mia_results import ENTIRE_DATASET_SLICE_STR
from tf_dpiter.auditing.mia_results import PrivacyMetric
from tf_dpiter.auditing.mia_results import RocCurve
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError

EPOCH_STR = "Epoch"
TRAIN_ACCURACY_STR = "Train accuracy"


def _pyplot():
  try:
    from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("membership-inference plots need matplotlib: "
                      "pip install \"tf_dpiter[plot]\" (or pip install matplotlib)") from None
  return pyplot


def plot_roc_curve(roc_curve):
  """The ROC curve (TPR against FPR) with its AUC, and the diagonal of random guessing.

  Args:
    roc_curve: a `RocCurve`, e.g. `results.get_result_with_max_auc().roc_curve`.

  Returns:
    a matplotlib `Figure`.

  Raises:
    ParameterTypeError: `roc_curve` is not a `RocCurve`.
    ImportError: matplotlib is not installed.
  """
  validation.check_instance("roc_curve", roc_curve, RocCurve, "a RocCurve")
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(5, 5))
  ax.plot([0, 1], [0, 1], "k", lw=1.0, label="guessing")
  ax.plot(roc_curve.fpr, roc_curve.tpr, lw=2, label=f"AUC: {roc_curve.get_auc():.3f}")
  ax.set_xlabel("FPR")
  ax.set_ylabel("TPR")
  ax.set_aspect("equal", adjustable="box")
  ax.legend(loc="lower right")
  return fig


def save_plot(figure, path, outformat="png"):
  """Writes `figure` to `path` and closes it.

  Args:
    figure: a matplotlib `Figure`.
    path: the output file.
    outformat: the image format ("png", "pdf", "svg", ...).

  Returns:
    path.
  """
  figure.savefig(path, bbox_inches="tight", format=outformat)
  _pyplot().close(figure)
  return path


def _results_list(results):
  if isinstance(results, AttackResultsCollection):
    return list(results.attack_results_list)
  if isinstance(results, AttackResults):
    return [results]
  if isinstance(results, (list, tuple)) and all(isinstance(r, AttackResults) for r in results):
    return list(results)
  raise ParameterTypeError(validation.message(
      "results", "an AttackResultsCollection (or a list of AttackResults)", results))


def _metric_value(result, bound, metric):
  """(value, DP bound on it or None) of one `SingleAttackResult`."""
  if metric == PrivacyMetric.AUC:
    return result.auc, None if bound is None else bound.max_auc
  if metric == PrivacyMetric.ATTACKER_ADVANTAGE:
    return result.attacker_advantage, None if bound is None else bound.max_advantage
  return result.get_ppv(), None


def _lines(results, x_field, privacy_metrics):
  """({metric: {legend label: [(x, value)]}}, {metric: {variant: [(x, DP bound)]}}) over the
  entire-dataset results; a variant's bound line only where all its results have a bound."""
  metrics = list(privacy_metrics)
  if not metrics or not all(isinstance(m, PrivacyMetric) for m in metrics):
    raise ParameterValueError(validation.message(
        "privacy_metrics", "a non-empty sequence of PrivacyMetric members", privacy_metrics))
  lines, bounds = {m: {} for m in metrics}, {m: {} for m in metrics}
  for i, res in enumerate(_results_list(results)):
    meta = res.privacy_report_metadata
    x = None if meta is None else getattr(meta, x_field)
    if x is None:
      raise ParameterValueError(validation.message(
          f"results[{i}].privacy_report_metadata.{x_field}",
          f"set (pass run_attacks(..., privacy_report_metadata=PrivacyReportMetadata("
          f"{x_field}=...)))", x))
    entire = [r for r in res.single_attack_results if r.slice_spec.entire_dataset]
    if not entire:
      raise ParameterValueError(validation.message(
          f"results[{i}]", "results with an entire-dataset slice (SlicingSpec("
          "entire_dataset=True))", res.summary()))
    for m in metrics:
      for r in entire:
        value, bound = _metric_value(r, res.privacy_bound, m)
        lines[m].setdefault(f"{meta.model_variant_label} - {r.attack_type}", []).append(
            (float(x), value))
      bounds[m].setdefault(meta.model_variant_label, []).append((float(x), bound))
  return lines, bounds


def _subplots(results, x_field, x_label, title, privacy_metrics):
  lines, bounds = _lines(results, x_field, privacy_metrics)
  plt = _pyplot()
  fig, axes = plt.subplots(1, len(lines), figsize=(5 * len(lines) + 3, 5), squeeze=False)
  fig.suptitle(title)
  styles = ("--", ":", "-.")
  for ax, metric in zip(axes[0], lines):
    for label, points in lines[metric].items():
      points.sort()
      ax.plot([p[0] for p in points], [p[1] for p in points], "-o", ms=3, label=label)
    for k, (variant, points) in enumerate(bounds[metric].items()):
      if all(p[1] is not None for p in points):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], styles[k % len(styles)],
                color="black", lw=1.0, label=f"{variant}: (epsilon, delta)-DP bound")
    ax.set_xlabel(x_label)
    ax.set_ylabel(str(metric))
    ax.set_title(f"{metric} for {ENTIRE_DATASET_SLICE_STR}")
  handles = {}
  for ax in axes[0]:
    for h, label in zip(*ax.get_legend_handles_labels()):
      handles.setdefault(label, h)
  axes[0][-1].legend(list(handles.values()), list(handles), loc="upper left",
                     bbox_to_anchor=(1.02, 1), fontsize=8)
  fig.tight_layout(rect=(0, 0, 1, 0.93))
  return fig


def plot_by_epochs(results, privacy_metrics):
  """Each metric of the entire-dataset slice against the epoch, per model variant and attack.

  Args:
    results: an `AttackResultsCollection` (or a list of `AttackResults`) whose
      `privacy_report_metadata.epoch_num` is set.
    privacy_metrics: `PrivacyMetric` members, one panel each.

  Returns:
    a matplotlib `Figure`.

  Raises:
    ParameterTypeError: `results` is not an `AttackResultsCollection` or list of
      `AttackResults`.
    ParameterValueError: no metric, a result without an epoch or an entire-dataset slice.
    ImportError: matplotlib is not installed.
  """
  return _subplots(results, "epoch_num", EPOCH_STR, "Vulnerability per epoch", privacy_metrics)


def plot_privacy_vs_accuracy(results, privacy_metrics):
  """Each metric of the entire-dataset slice against the training accuracy.

  Args:
    results: an `AttackResultsCollection` (or a list of `AttackResults`) whose
      `privacy_report_metadata.accuracy_train` is set.
    privacy_metrics: `PrivacyMetric` members, one panel each.

  Returns:
    a matplotlib `Figure`.

  Raises:
    ParameterTypeError: `results` is not an `AttackResultsCollection` or list of
      `AttackResults`.
    ParameterValueError: no metric, a result without a training accuracy or an
      entire-dataset slice.
    ImportError: matplotlib is not installed.
  """
  return _subplots(results, "accuracy_train", TRAIN_ACCURACY_STR, "Privacy vs utility",
                   privacy_metrics)
