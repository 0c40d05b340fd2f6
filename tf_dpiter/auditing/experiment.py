"""One white-box DP-SGD audit, end to end: canaries in, real `fit`, claim beside bound.

`run_whitebox_audit` appends Dirac canary records to a training set, trains the DP model
(`tf_dpiter.keras`, plain DP SGD, Poisson batches from `tf_dpiter.data.poisson_batches`)
with `CanaryRecorder` watching, and returns the claimed ε (from the model's ledger and from
dp_accounting events built by hand) beside the empirical lower bounds.
"""

import dataclasses
from typing import Optional

import numpy as np

from tf_dpiter import accounting
from tf_dpiter.auditing import callback as callback_lib
from tf_dpiter.auditing import canaries as canaries_lib
from tf_dpiter.auditing import whitebox
from tf_dpiter.data import sampling
from tf_dpiter.keras.optimizer import optimizers as dp_optimizers


@dataclasses.dataclass
class WhiteBoxResult:
  """Outcome of `run_whitebox_audit`; the claims are computed on demand from dp_accounting
  events (per step: every step is an independent one-step run for the canary coordinates).

  Attributes:
    ledger_epsilon: epsilon the model's ledger reports, None if not asked.
    run_bound: the bounds.LowerBound from per-run scores.
    step_bound: the bounds.LowerBound from per-step scores.
    observations: [m, T] the canaries' observed updates.
    included: [m] which canaries were in the training data.
    sampling_probability: q.
    steps: T.
    noise_multiplier: z.
    delta: the delta of the claims and bounds.
    neighbouring: the neighbouring relation audited.
    model: the trained DiracCanaryModel (`model.base` is the user's model).
    audit_callback: the AuditCallback if audit_kwargs was given, else None.
  """
  ledger_epsilon: Optional[float]
  run_bound: object
  step_bound: object
  observations: np.ndarray
  included: np.ndarray
  sampling_probability: float
  steps: int
  noise_multiplier: float
  delta: float
  neighbouring: str
  model: object = None
  audit_callback: object = None

  def claimed_epsilon(self, accountant="pld", sensitivity=1.0):
    """The claimed ε of the T-step run, from dp_accounting events (`whitebox.claimed_epsilon`).

    Args:
      accountant: "pld" or "rdp".
      sensitivity: the sensitivity in units of the clip S (2 for replace-one adjacency).

    Returns:
      ε, a float (inf when z = 0).
    """
    return whitebox.claimed_epsilon(self.sampling_probability, self.noise_multiplier, self.steps,
                                    self.delta, accountant, sensitivity)

  def step_claimed_epsilon(self, accountant="pld", sensitivity=1.0):
    """The claimed ε of one step (T = 1) of the run: the claim the per-step trials audit.

    Args:
      accountant: as `claimed_epsilon`.
      sensitivity: as `claimed_epsilon`.

    Returns:
      ε, a float.
    """
    return whitebox.claimed_epsilon(self.sampling_probability, self.noise_multiplier, 1,
                                    self.delta, accountant, sensitivity)


def run_whitebox_audit(base_model, x, y, num_classes, *, num_canaries, noise_multiplier,
                       sampling_probability, steps, l2_norm_clip=1.0, learning_rate=0.1,
                       delta=1e-5, confidence=0.95, p_in=0.5,
                       neighbouring=canaries_lib.ADD_REMOVE, design_seed=0, sampling_seed=None,
                       noise_seed=None, ledger_accountant="pld", epochs=1, audit_kwargs=None,
                       callbacks=()):
  """Trains `base_model` privately with m Dirac canaries and audits the run.

  Args:
    base_model: Keras model x -> logits [B, num_classes] (sparse cross-entropy on logits).
    x: the training features (n examples).
    y: their integer labels [n].
    num_classes: K.
    num_canaries: m (about p_in * m become records; all m with neighbouring="replace").
    noise_multiplier: z of the DP optimizer (noise stddev z * S).
    sampling_probability: Poisson q in (0, 1]; the expected batch size is q * n_total
      (n_total includes the canary records).
    steps: Poisson samples per epoch (T = steps * epochs in all).
    l2_norm_clip: S.
    learning_rate: SGD step (any value; the audit divides it out).
    delta: the delta of the claim and of the bounds.
    confidence: the confidence of the bounds.
    p_in: probability a canary is included (or has sign +1).
    neighbouring: "add_remove" or "replace".
    design_seed: seeds the canary membership (audit design).
    sampling_seed: seeds the sampling, for tests only (a reproducible run is NOT private).
    noise_seed: seeds the noise, for tests only (a reproducible run is NOT private).
    ledger_accountant: accountant for the ledger's ε ("pld" or "rdp"), or None to skip it.
    epochs: epochs of `steps` samples each.
    audit_kwargs: if given, an AuditCallback(delta, recorder=..., **audit_kwargs) audits every
      epoch (e.g. attack_fn=..., report_path=...); it is returned as result.audit_callback.
    callbacks: further Keras callbacks for fit.

  Returns:
    WhiteBoxResult.

  Raises:
    ParameterValueError: arguments out of range (from the helpers it calls).
  """
  included = canaries_lib.draw_membership(num_canaries, design_seed, p_in)
  x_all, y_all = _with_canaries(x, y, num_classes, included, neighbouring)
  n_total = x_all.shape[0]
  data = sampling.poisson_batches(x_all, y_all, expected_batch_size=sampling_probability * n_total,
                                  steps_per_epoch=steps, seed=sampling_seed)
  q = sampling.get_sampling_spec(data).selection_probability
  model = _compiled_canary_model(base_model, x_all, num_classes, num_canaries, l2_norm_clip,
                                 noise_multiplier, learning_rate, noise_seed)
  recorder = whitebox.CanaryRecorder(model, l2_norm_clip, q * n_total)
  audit_cb = None
  if audit_kwargs is not None:
    audit_cb = callback_lib.AuditCallback(
        delta, recorder=recorder, included=included, sampling_probability=q,
        noise_multiplier=noise_multiplier, neighbouring=neighbouring, confidence=confidence,
        **audit_kwargs)
  model.fit(data, epochs=epochs, verbose=0,
            callbacks=[recorder if audit_cb is None else audit_cb, *callbacks])
  obs = recorder.observations
  ledger_eps = None
  if ledger_accountant is not None and noise_multiplier > 0:
    ledger_eps = float(accounting.epsilon(model.ledger, delta, accountant=ledger_accountant))
  bound_args = dict(sampling_probability=q, noise_multiplier=noise_multiplier, delta=delta,
                    confidence=confidence, neighbouring=neighbouring)
  run_b = whitebox.whitebox_lower_bound(obs, included, per="run", **bound_args)
  step_b = whitebox.whitebox_lower_bound(obs, included, per="step", **bound_args)
  return WhiteBoxResult(ledger_eps, run_b, step_b, obs, included, q, recorder.steps,
                        float(noise_multiplier), delta, neighbouring, model, audit_cb)


def _with_canaries(x, y, num_classes, included, neighbouring):
  """The training arrays with the canary records (`canaries.canary_records`) appended."""
  cx, cy = canaries_lib.canary_records(np.shape(x)[1:], num_classes, included, neighbouring,
                                       dtype=np.asarray(x).dtype)
  x_all = np.concatenate([np.asarray(x), cx])
  y_all = np.concatenate([np.asarray(y).astype(np.int64).reshape(-1), cy])
  return x_all, y_all


def _compiled_canary_model(base_model, x_all, num_classes, num_canaries, l2_norm_clip,
                           noise_multiplier, learning_rate, noise_seed):
  """`base_model` wrapped for the canaries, compiled with plain DP SGD and built."""
  model = canaries_lib.wrap_model(base_model, num_canaries)
  opt = dp_optimizers.DPKerasSGDOptimizer(l2_norm_clip, noise_multiplier,
                                          learning_rate=learning_rate, clipping="vectorized",
                                          seed=noise_seed)
  model.compile(optimizer=opt, loss=canaries_lib.DiracCanaryLoss(num_classes, num_canaries,
                                                                 l2_norm_clip))
  model(x_all[:1])
  return model
