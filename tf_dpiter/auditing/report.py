"""PNG privacy report: claimed ε, audited ε lower bounds and attack AUC over training."""

import math

import numpy as np

from tf_dpiter.errors import PrivacyConfigError

_BOUND_KEYS = (("whitebox_epsilon_lb", "white-box bound (per run)"),
               ("whitebox_step_epsilon_lb", "white-box bound (per step)"),
               ("attack_epsilon_lb", "black-box bound (one run)"))


def _series(history, key):
  return np.array([np.nan if r.get(key) is None else float(r[key]) for r in history])


def plot_privacy_report(history, path, title="Privacy audit"):
  """Writes a two-panel PNG: (left) ε vs epoch, (right) attack AUC vs claimed ε.

  Args:
    history: AuditCallback's list of dicts: "epoch", "claimed_epsilon" and any of
      "whitebox_epsilon_lb", "whitebox_step_epsilon_lb", "attack_epsilon_lb", "attack_auc".
    path: output PNG path.
    title: figure title.

  Returns:
    path.

  Raises:
    PrivacyConfigError: empty history or a row without "epoch" / "claimed_epsilon".
  """
  if not history or any("epoch" not in r or "claimed_epsilon" not in r for r in history):
    raise PrivacyConfigError("history must be a non-empty list of dicts with 'epoch' and "
                             f"'claimed_epsilon', got {history!r:.200}")
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  epochs = _series(history, "epoch")
  claimed = _series(history, "claimed_epsilon")
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  finite = np.where(np.isfinite(claimed), claimed, np.nan)
  ax1.plot(epochs, finite, "k-o", label="claimed ε (accountant)")
  for key, label in _BOUND_KEYS:
    s = _series(history, key)
    if np.any(np.isfinite(s)):
      ax1.plot(epochs, s, "-s", label=label)
  ax1.set_xlabel("epoch")
  ax1.set_ylabel("ε (nats)")
  ax1.legend(fontsize=8)
  ax1.set_title("claimed ε vs audited lower bounds")
  auc = _series(history, "attack_auc")
  if np.any(np.isfinite(auc)):
    x = finite if np.any(np.isfinite(finite)) else epochs
    ax2.plot(x, auc, "-o", color="tab:red")
    ax2.set_xlabel("claimed ε" if np.any(np.isfinite(finite)) else "epoch (claimed ε infinite)")
  else:
    ax2.text(0.5, 0.5, "no attack run", ha="center", va="center")
  ax2.axhline(0.5, color="grey", lw=0.8, ls="--")
  ax2.set_ylabel("attack AUC")
  ax2.set_title("membership attack AUC")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def format_summary(rows):
  """The plain-text table of audit rows, one line per model (what CLIs and tutorials print).

  Args:
    rows: {model name: {"claimed_epsilon": ..., "lira_epsilon_lb": ..., "lira_auc": ...,
      "loss_auc": ..., "whitebox_*": ...}}; a missing or None entry prints as "-", an infinite
      one as "inf", the others to 3 decimals.

  Returns:
    str: a header line, then one line per model in the order of `rows`.
  """
  keys = ["claimed_epsilon", "lira_epsilon_lb", "lira_auc", "loss_auc", "whitebox_claimed_epsilon",
          "whitebox_epsilon_lb", "whitebox_step_claimed_epsilon", "whitebox_step_epsilon_lb"]
  heads = ["claimed eps", "LiRA lb", "LiRA AUC", "loss AUC", "wb claim", "wb lb",
           "wb step claim", "wb step lb"]
  lines = ["model".ljust(14) + "".join(h.ljust(15) for h in heads)]
  for name, row in rows.items():
    cells = [("-" if v is None else "inf" if v == math.inf else f"{v:.3f}").ljust(15)
             for v in map(row.get, keys)]
    lines.append(name.ljust(14) + "".join(cells))
  return "\n".join(lines)
