"""Reports of a DP federated averaging run (Geyer et al. 2017, Table 1 and Section 6).

`RoundReport` describes one communication round, `RunReport` the run with its privacy
statement; `update_statistics` computes the between-clients variance V_c and the update scale
U_s of Geyer et al. 2017, Section 6 (diagnostics on raw client updates: NOT differentially private).
"""

import dataclasses
from typing import List, Optional, Tuple

import tensorflow as tf

__all__ = ["RoundReport", "RunReport", "update_statistics"]


@dataclasses.dataclass
class RoundReport:
  """One communication round (Geyer et al. 2017, Table 1).

  Attributes:
    round: t, counting from 1.
    clients: the records aggregated this round (m_t, or the Poisson draw: the realized draw is
      NOT differentially private, a diagnostic for the trusted server).
    noise_multiplier: the round's total z (Eq. (1) of McMahan et al. 2018 over its events).
    accuracy: accuracy of w_t on the evaluation data, or None.
    communication_rounds: communication rounds so far ("CR", Table 1).
    communication_costs: client updates summed over the rounds so far ("CC", Table 1);
      under Poisson sampling the realized draws, NOT differentially private (as `clients`).
    clip: the clip the round used (None without one).
    between_clients_variance: V_c (Section 6) of the round's unclipped updates: a diagnostic,
      NOT differentially private.
    update_scale: U_s (Section 6) of the round's unclipped updates: NOT differentially private.
    rejected: updates rejected (non-finite, wrong shape, lost): NOT differentially private
      (one client's non-finite update shows as 1 in every round that samples it), a
      diagnostic for the trusted server; do not publish it with the model.
    epsilon: the guarantee's epsilon after this round (fixed, or the one at the fixed delta).
    delta: the guarantee's delta after this round (fixed, or the one at the fixed epsilon).
    seconds: wall time of the round.
    average_accuracy: accuracy of the moving average of the w_t, or None.
  """
  round: int
  clients: int
  noise_multiplier: float
  accuracy: Optional[float]
  communication_rounds: int
  communication_costs: int
  clip: Optional[float]
  between_clients_variance: float
  update_scale: float
  rejected: int
  epsilon: Optional[float]
  delta: Optional[float]
  seconds: float
  average_accuracy: Optional[float] = None


@dataclasses.dataclass
class RunReport:
  """The run: per-round reports, why it stopped, and the privacy statement.

  Attributes:
    rounds: the RoundReports.
    stopped_reason: why the run ended (max_rounds, or the privacy budget).
    guarantee_holds: False for median clipping or a non-private query.
    privacy_statement: the accountant's statement on the ledger.
    warnings: what the statement does not cover.
  """
  rounds: List[RoundReport]
  stopped_reason: str
  guarantee_holds: bool
  privacy_statement: str
  warnings: Tuple[str, ...]

  @property
  def accuracy(self):
    """Accuracy of w_t after the last evaluated round, or None."""
    return next((r.accuracy for r in reversed(self.rounds) if r.accuracy is not None), None)

  @property
  def average_accuracy(self):
    """Accuracy of the exponential moving average of w_t after the last round (if kept)."""
    return next((r.average_accuracy for r in reversed(self.rounds)
                 if r.average_accuracy is not None), None)

  @property
  def communication_rounds(self):
    """Communication rounds run ("CR" of Geyer et al. 2017, Table 1), an int."""
    return len(self.rounds)

  @property
  def communication_costs(self):
    """Communication costs: client updates summed over the rounds ("CC" of Geyer et al. 2017,
    Table 1); under Poisson sampling the realized draws: NOT differentially private."""
    return self.rounds[-1].communication_costs if self.rounds else 0

  def __str__(self):
    lines = [f"rounds (CR) = {self.communication_rounds}, CC = {self.communication_costs}, "
             f"accuracy = {self.accuracy}"
             + ("" if self.average_accuracy is None
                else f", accuracy of the averaged model = {self.average_accuracy}"),
             f"stopped: {self.stopped_reason}", self.privacy_statement]
    lines += [f"WARNING: {w}" for w in self.warnings]
    return "\n".join(lines)


def update_statistics(records, mask):
  """(V_c, U_s) of Geyer et al. 2017, Section 6 over the rows of `records` with mask 1.

  V_c = (1/qp) sum_ij Var_k[Delta w_ij]; U_s = (1/qp) sum_ij mu_ij^2, mu = mean_k Delta w.

  Args:
    records: float32 [M, d] client updates.
    mask: [M] 0/1 weights of the accepted rows.

  Returns:
    (V_c, U_s), scalar float32 tensors.
  """
  mask = tf.cast(mask, tf.float32)[:, None]
  n = tf.maximum(tf.reduce_sum(mask), 1.0)
  mu = tf.reduce_sum(records * mask, 0) / n
  var = tf.reduce_sum(tf.square(records - mu) * mask, 0) / n
  return tf.reduce_mean(var), tf.reduce_mean(tf.square(mu))
