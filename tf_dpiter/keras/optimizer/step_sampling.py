"""The sampling a DP step declares: the LedgerSampling that records it with every sample.

McMahan et al., "A General Approach to Adding Differential Privacy to Iterative Training
Procedures" (2018), Section 6: the ledger records, with every sample, n, q, the policy (its
neighbouring relation: add/remove one example under Poisson-type sampling, replace-one under
"shuffle" and "fixed_size") and the sample size. A microbatch record of k = ceil(B / M)
examples is charged at 2S (Table 1, Appendix A) and needs a replace-one policy; M = B is
k = 1, per-example clipping under any policy (Abadi et al. 2016, Section 3.1). The declared
n and q are public parameters and must not be computed from the private data
(`keras.model.fit_sampling`).
"""

import numpy as np
import tensorflow as tf

from tf_dpiter import ledger as ledger_lib
from tf_dpiter import validation
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import policies as ledger_policies
from tf_dpiter.ledger import records
from tf_dpiter.ledger import privacy_ledger


def record_microbatches(num_microbatches, sample_size):
  """M as the records of a batch are cut for the declared (expected) batch size B: None when a
  record is one example (M None, or M == B: TF Privacy's default, so removing an example
  removes its own record only), else M."""
  if num_microbatches is None or (sample_size and float(num_microbatches) == float(sample_size)):
    return None
  return num_microbatches


def check(step, population_size, policy, sample_size, steps_per_pass=None):
  """Refuses a declaration the step cannot be accounted under (`steps_per_pass`: the sampler's
  steps of one shuffled pass, or None).

  Raises:
    PrivacyConfigError: microbatches under add/remove, a sampling the correlated mechanism is
      not accounted under, or a new sampling inside one of its trees.
  """
  privacy_ledger.check_sample_size(sample_size)
  step.mechanism.check_sampling(policy, population_size, sample_size,
                                steps_per_pass=steps_per_pass)
  step.mechanism.check_boundary(step.noise_state())
  m = record_microbatches(step.num_microbatches, sample_size)
  if m is not None and ledger_lib.relation_for_policy(policy) == ledger_lib.ADD_OR_REMOVE:
    raise PrivacyConfigError(
        f"num_microbatches={m} cannot be used with policy {policy!r} and batch size "
        f"{sample_size:g}: under add or remove one example, removing an example re-deals the "
        "others among microbatches of several examples. Sample with shuffled passes "
        "(model.fit(..., sampling=\"shuffle\") or dp.data.shuffled_batches), or use "
        "num_microbatches=None or num_microbatches equal to the batch size (one example "
        "per microbatch: per-example clipping)")


def recorded_units(step):
  """The units ("user", "example") of the private sampling rows the step's ledger (or the
  ledger waiting for it, restored from a config or weights file) holds; selection markers
  left out (eager)."""
  ledger = step.existing_ledger
  if ledger is not None:
    with tf.init_scope():
      samples = ledger.get_arrays()[0] if int(ledger.sample_count.numpy()) else None
  else:
    pending = step.restored_ledger
    samples = None if pending is None else pending[0]
  if samples is None or not samples.shape[0]:
    return set()
  names = {records.policy_name(c) for c in np.unique(samples[:, 3])}
  return {records.unit_of_policy(p) for p in names if p != records.REPEAT_AND_SELECT}


def check_unit(step, policy):
  """Refuses a sampling whose record is another unit than the ledger's rows': a user-level
  phase (record = a user, sensitivity S per user) and an example-level one on one ledger
  protect neither unit at the recorded sensitivities (for one example, a user's record moves
  by up to 2S when one of its examples goes; for one user, the example phase saw each of
  the user's k examples: group privacy over k), so no statement covers their composition.

  A Keras step's record is an example, a microbatch or (user-level data) a user, never a
  client's model update: a client-unit policy ("client_poisson", "client_fixed_size", the
  federated server's) is refused, declared by hand or by a dataset.

  Raises:
    PrivacyConfigError: a client-unit policy, or the ledger holds rows of another unit (the
      message says what to do).
  """
  unit = ledger_policies.get(policy).unit
  if unit == "client":
    raise PrivacyConfigError(validation.message(
        "policy", f"a policy whose record is an example, a microbatch or a user ({policy!r} "
        "makes a record of one client: a Keras step clips examples, while a client-level "
        "policy states the sensitivity per client update). For client-level DP use "
        "dp.federated.DPFedAvg, which records its rounds under these policies", policy))
  others = recorded_units(step) - {unit}
  if others:
    other = sorted(others)[0]
    raise PrivacyConfigError(
        f"this optimizer's ledger holds {other}-level steps (a record is one {other}) and "
        f"this sampling, policy {policy!r}, makes a record of one {unit}: one ledger would "
        f"compose steps that protect different units, and neither one {other} nor one "
        f"{unit} is protected at the sensitivities recorded (a user's clipped record moves "
        "by up to 2S when one of its examples is removed; an example-level step samples each "
        "of a user's examples on its own). Use a new optimizer (a new run, its own ledger) "
        f"for the {unit}-level training, and state the two runs' guarantees separately. "
        f"Received: policy={policy!r}")


def declare(step, population_size, selection_probability, policy, sample_size):
  """Makes the step's LedgerSampling (on the step's ledger), or re-declares its sampling; the
  query's global state variables are made once and the expected records set. Returns True
  when the recorded policy, the record unit or the public row bounds (`row_bound_key`)
  changed: the step must be retraced."""
  m = record_microbatches(step.num_microbatches, sample_size)
  k = 1 if m is None else max(1, -(-int(sample_size) // m))
  changed_cut = step.adopt_record_microbatches(m)   # None: the train step cuts per example
  step.make_state()
  expected = ledger_policies.get(policy).expected_records(population_size,
                                                          selection_probability, sample_size)
  with tf.init_scope():
    sampling = step.sampling
    if sampling is None or sampling.policy != policy:
      sampling = ledger_lib.LedgerSampling(
          population_size, selection_probability, ledger=step.ledger, policy=policy,
          sample_size=sample_size, examples_per_record=k)
      changed = True
    else:
      # the record unit and the public row bound (chunking.public_rows) are read when traced
      traced = (sampling.examples_per_record, sampling.row_bound_key)
      sampling.set_sampling(population_size, selection_probability, sample_size,
                            examples_per_record=k)
      changed = changed_cut or traced != (k, sampling.row_bound_key)
    step.adopt_sampling(sampling, expected)
  return changed

