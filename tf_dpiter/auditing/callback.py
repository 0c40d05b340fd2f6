"""`AuditCallback`: claimed epsilon beside audited lower bounds and attack AUC, epoch by epoch.

Every `every_n_epochs`-th epoch: claimed_epsilon (the ledger's), whitebox_epsilon_lb /
whitebox_step_epsilon_lb (Dirac canaries, with a `CanaryRecorder`), attack_auc /
attack_epsilon_lb (`attack_fn(model) -> (scores, is_member, labels)`, one-run bound of
Steinke et al. 2023), into Keras' `logs` and `history`; `report_path` gets the PNG report.
"""

import math

import keras
import numpy as np

from tf_dpiter import accounting
from tf_dpiter import validation
from tf_dpiter.auditing import attacks
from tf_dpiter.auditing import canaries as canaries_lib
from tf_dpiter.auditing import report as report_lib
from tf_dpiter.auditing import whitebox
from tf_dpiter.errors import PrivacyConfigError


class AuditCallback(keras.callbacks.Callback):
  """Audits a DP Keras model while it trains (see module docstring); its hooks drive the
  recorder, which turns every step's canary update into x_kt (Eq. 4).

  Args:
    delta: δ of the claim and of the bounds, in (0, 1).
    recorder: optional whitebox.CanaryRecorder of the model's Dirac canaries (the callback
      drives it; do not pass it to fit as well).
    included: bool [m] canary membership (needed with recorder).
    sampling_probability: Poisson q of the run (needed with recorder).
    noise_multiplier: z of the DP optimizer (needed with recorder).
    neighbouring: "add_remove" or "replace" (canary design).
    attack_fn: optional callable(model) -> (scores [n], is_member [n], labels [n] or None).
    accountant: "rdp", "pld" or another registered accountant
      (`accounting.register_accountant`) for the ledger's ε.
    confidence: 1 - α of the bounds.
    every_n_epochs: audit period (epochs).
    report_path: optional PNG path written at the end of training.

  Raises:
    PrivacyConfigError: recorder given without included / sampling_probability /
      noise_multiplier.
    ParameterValueError: every_n_epochs < 1.
  """

  def __init__(self, delta, *, recorder=None, included=None, sampling_probability=None,
               noise_multiplier=None, neighbouring=canaries_lib.ADD_REMOVE, attack_fn=None,
               accountant="rdp", confidence=0.95, every_n_epochs=1, report_path=None):
    super().__init__()
    if recorder is not None and (included is None or sampling_probability is None
                                 or noise_multiplier is None):
      raise PrivacyConfigError("recorder needs included, sampling_probability and noise_multiplier; got "
                               f"included={'set' if included is not None else None}, "
                               f"sampling_probability={sampling_probability!r}, "
                               f"noise_multiplier={noise_multiplier!r}")
    validation.check_integer("every_n_epochs", every_n_epochs, 1)
    accounting.accountant.check_bound_accountant(accountant, "AuditCallback")
    self.delta = float(delta)
    self.recorder = recorder
    self.included = None if included is None else np.asarray(included, bool)
    self.sampling_probability = sampling_probability
    self.noise_multiplier = noise_multiplier
    self.neighbouring = neighbouring
    self.attack_fn = attack_fn
    self.accountant = accountant
    self.confidence = float(confidence)
    self.every_n_epochs = every_n_epochs
    self.report_path = report_path
    self.history = []

  # The recorder's hooks run from here, so the order relative to other callbacks is fixed.
  def on_train_begin(self, logs=None):
    if self.recorder is not None:
      self.recorder.set_model(self.model)
      self.recorder.on_train_begin(logs)

  def on_train_batch_begin(self, batch, logs=None):
    if self.recorder is not None:
      self.recorder.on_train_batch_begin(batch, logs)

  def on_train_batch_end(self, batch, logs=None):
    if self.recorder is not None:
      self.recorder.on_train_batch_end(batch, logs)

  def _claimed(self):
    return math.inf if self.noise_multiplier == 0 else float(
        accounting.epsilon(self.model.ledger, self.delta, accountant=self.accountant))

  def audit(self):
    """The audit now: the ledger's claim beside the available empirical bounds.

    Returns:
      a dict: "claimed_epsilon" (from the model's ledger; inf when z = 0), with a recorder
      "whitebox_epsilon_lb" and "whitebox_step_epsilon_lb", with attack_fn "attack_auc" and
      "attack_epsilon_lb".
    """
    row = {"claimed_epsilon": self._claimed()}
    if self.recorder is not None and self.recorder.steps > 0:
      args = dict(sampling_probability=self.sampling_probability,
                  noise_multiplier=self.noise_multiplier, delta=self.delta,
                  confidence=self.confidence, neighbouring=self.neighbouring)
      obs = self.recorder.observations
      row["whitebox_epsilon_lb"] = whitebox.whitebox_lower_bound(
          obs, self.included, per="run", **args).epsilon
      row["whitebox_step_epsilon_lb"] = whitebox.whitebox_lower_bound(
          obs, self.included, per="step", **args).epsilon
    if self.attack_fn is not None:
      scores, is_member, labels = self.attack_fn(self.model)
      m = attacks.attack_metrics(scores, is_member, labels, self.delta, self.confidence)
      row["attack_auc"] = m.auc
      row["attack_epsilon_lb"] = m.epsilon_lower_bound
    return row

  def on_epoch_end(self, epoch, logs=None):
    if (epoch + 1) % self.every_n_epochs:
      return
    row = self.audit()
    row["epoch"] = epoch + 1
    self.history.append(row)
    if logs is not None:
      logs.update({k: v for k, v in row.items() if v is not None})

  def on_train_end(self, logs=None):
    if self.report_path and self.history:
      report_lib.plot_privacy_report(self.history, self.report_path)
