"""The privacy ledger of a DP optimizer in its Keras config, and supplying a ledger by hand.

Rule: every noised step ever taken is charged (McMahan et al., "A General Approach to Adding
Differential Privacy to Iterative Training Procedures", Section 6), so the ledger travels
with the model: `get_config` writes the ledger's signed dict under "dp_ledger" and
`from_config` verifies it and starts the new ledger from it; a `tf.train.Checkpoint` carries
it as the `_dp_ledger` dependency. A model restored without its ledger (iterations > ledger
samples) is refused by `fit` until `optimizer.restore_ledger(...)` supplies it.

The config's digest is SHA-256: it detects accidents, not a deliberate edit; export the
ledger with `save_json(path, key=...)` for an HMAC.
"""

import json
import os

import numpy as np
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import ledger_file
from tf_dpiter.ledger import records as rec
from tf_dpiter.ledger import run_ids
from tf_dpiter.ledger import schema

CONFIG_KEY = "dp_ledger"


def check_counts(iterations, samples):
  """Refuses `iterations` optimizer steps charged by fewer than `iterations` ledger `samples`.

  Raises:
    PrivacyConfigError: samples < iterations (the message says how to supply the ledger).
  """
  if samples < iterations:
    raise PrivacyConfigError(
        f"the model's optimizer has taken iterations={iterations} steps but its privacy "
        f"ledger holds {samples} samples: the model was restored without its ledger (e.g. "
        "load_weights, a tf.train.Checkpoint without the optimizer, or a copy saved before "
        "this version) or from a journal that lost steps, so epsilon would leave out earlier "
        "steps. Refusing to train. Supply the ledger first: "
        "model.optimizer.restore_ledger(path) with the run's ledger JSON (ledger.save_json / "
        "LedgerExport), or fit(..., ledger_journal=path) with the run's journal")


def require_covers(opt):
  """`check_counts` on the DP optimizer `opt`, read eagerly (also while a tf.function is traced).

  Raises:
    PrivacyConfigError: its iterations exceed its ledger's samples.
  """
  ledger = opt.private_step.existing_ledger   # None until the step's state is made
  if ledger is None:   # no sampling declared yet: the private step refuses to run anyway
    return
  with tf.init_scope():
    iterations = int(opt.iterations.numpy())
    samples = int(ledger.sample_count.numpy())
  check_counts(iterations, samples)


def arrays_of_config(d):
  """(samples, queries, passes, grouping) of a config's signed "dp_ledger" dict `d`, verified.

  Raises:
    ParameterValueError: the dict is malformed or altered (names the config field).
  """
  try:
    return ledger_file.dict_to_state(d)
  except ValueError as e:
    raise ParameterValueError(f"the optimizer config's {CONFIG_KEY!r}: {e}") from None


def config_ledger(opt):
  """The signed dict of `opt`'s ledger (or of the one pending from from_config); None when there
  is none or it holds no sample and no pass."""
  arrays = arrays_of(opt)
  if arrays is None:
    return None
  ledger = opt.private_step.existing_ledger
  return ledger.to_dict() if ledger is not None else ledger_file.arrays_to_dict(
      *arrays[:2], passes=arrays[2], grouping=arrays[3] if len(arrays) > 3 else None,
      runs=arrays[4] if len(arrays) > 4 else None)


def arrays_of(opt):
  """(samples, queries, passes[, grouping[, run table]]) of the ledger `opt` charges: its
  ledger, or the one pending from from_config or a loaded weights file; None when it holds no
  sample and no pass."""
  ledger = opt.private_step.existing_ledger   # None until the step's state is made
  if ledger is None:
    return opt.private_step.restored_ledger
  if int(ledger.sample_count.numpy()) == 0 and int(ledger.passes.numpy()) == 0:
    return None
  return ledger.state()


def _mechanism_mismatch(opt, samples, queries):
  """Why the ledger's last sample was not made by `opt`'s mechanism and sampling, or None.

  Compared: the noise multiplier z = sigma / S and the clip S of the default Gaussian query
  (a custom dp_query or a correlated mechanism: the kind of its rows), and, once the
  optimizer's sampling is declared, the policy (hence the relation and the unit) and the
  examples per record k.
  """
  if samples.shape[0] == 0:
    return None
  last = samples.shape[0] - 1
  rows = queries[queries[:, 0] == last]
  step = opt.private_step
  if not step.custom_query and step.noise == "iid" and rows.shape[0]:
    kind, clip, noise = rows[0, 1], rows[0, 2], rows[0, 3]
    z = noise / clip if clip > 0 else float("inf")
    if (kind != rec.GAUSSIAN or not np.isclose(clip, step.l2_norm_clip, rtol=1e-6)
        or not np.isclose(z, step.noise_multiplier, rtol=1e-6)):
      return (f"its last step used a {schema.KIND_NAME.get(int(kind), kind)} query with "
              f"l2_norm_clip={clip:g} and noise_multiplier={z:g}, this optimizer uses "
              f"l2_norm_clip={step.l2_norm_clip:g} and noise_multiplier="
              f"{step.noise_multiplier:g}")
  sampling = step.sampling
  if sampling is not None:
    policy = rec.policy_name(int(samples[last, 3]))
    k = int(samples[last, 4])
    if policy != sampling.policy or k != sampling.examples_per_record:
      return (f"its last step was sampled under policy {policy!r} ({rec.relation_for_policy(policy)}"
              f", {rec.unit_of_policy(policy)}) with examples_per_record={k}, this optimizer "
              f"declares policy {sampling.policy!r} with examples_per_record="
              f"{sampling.examples_per_record}")
  return None


def restore_ledger(opt, ledger, key=None):
  """Supplies the run's ledger to a restored optimizer: merged into its ledger
  (`PrivacyLedger.merge_arrays`, so nothing the optimizer recorded is lost).

  Args:
    opt: a DP optimizer.
    ledger: a PrivacyLedger, a signed ledger dict, or the path of a ledger JSON file
      (`PrivacyLedger.save_json`, `callbacks.LedgerExport`).
    key: the HMAC key the dict or file was signed with, or None (digest only).

  Returns:
    `opt.ledger`, now charging `ledger`'s samples and passes.

  Raises:
    ParameterValueError: the file or dict is malformed or fails verification.
    PrivacyConfigError: it holds fewer samples than the optimizer's iterations, or its last
      step's mechanism (clip, noise multiplier) or sampling (policy, hence relation and
      unit; examples per record) is not this optimizer's: it is another run's ledger.
  """
  if hasattr(ledger, "state") and hasattr(ledger, "passes"):
    arrays = ledger.state()
  elif isinstance(ledger, dict):
    arrays = ledger_file.dict_to_state(ledger, key)
  elif isinstance(ledger, (str, os.PathLike)):
    arrays = ledger_file.load(os.fspath(ledger), key, with_grouping=True)
  else:
    raise PrivacyConfigError(f"ledger must be a PrivacyLedger, a ledger dict or a ledger JSON path. "
                             f"Received: ledger={ledger!r}")
  iterations = int(opt.iterations.numpy())
  if arrays[0].shape[0] < iterations:
    raise PrivacyConfigError(f"the ledger holds {arrays[0].shape[0]} samples but the optimizer has "
                             f"taken iterations={iterations} steps: it is not this run's complete "
                             "ledger; supply the ledger written at or after the last step")
  mismatch = _mechanism_mismatch(opt, arrays[0], arrays[1])
  if mismatch is not None:
    raise PrivacyConfigError(f"restore_ledger: this ledger is not this run's: {mismatch}. "
                             "Supply the ledger of the run that trained these weights")
  target = opt.private_step.ledger
  with tf.init_scope():
    target.merge_arrays(*arrays)
  return target


# The ledger in the model's own weights-file entry (`DPModelMixin.save_own_variables`): a
# model saved with `model.save` or `save_weights` carries its ledger even where its optimizer
# is not restored (`load_model(compile=False)`, `load_weights` into a new model), and a DP
# optimizer compiled on it continues that ledger.
STORE_KEYS = ("dp_ledger_samples", "dp_ledger_queries", "dp_ledger_passes")
GROUPING_KEY = "dp_ledger_cyclic_grouping"   # uint8 bytes of the record, when there is one
RUN_IDS_KEY = "dp_ledger_run_ids"   # uint8 bytes of the run table's JSON (`run_ids`)


def write_to_store(opt, store):
  """Writes `opt`'s ledger arrays into the Keras weights-store entry `store` (no-op unless `opt`
  is a DP optimizer with a ledger)."""
  step = getattr(opt, "private_step", None)
  ledger = None if step is None else step.existing_ledger
  if ledger is None or int(ledger.sample_count.numpy()) == 0:
    return
  samples, queries = ledger.get_arrays()
  for name, value in zip(STORE_KEYS, (samples, queries, np.int64(ledger.passes.numpy()))):
    store[name] = value
  grouping = ledger.cyclic_grouping
  if grouping is not None:
    store[GROUPING_KEY] = np.frombuffer(grouping.encode(), np.uint8)
  table = json.dumps([list(e) for e in ledger.run_table()], separators=(",", ":"))
  store[RUN_IDS_KEY] = np.frombuffer(table.encode(), np.uint8)


def split_store(store):
  """(the entry without the ledger's keys as a dict, the carried (samples, queries, passes,
  grouping, run table) or None), from the entry Keras passes to `load_own_variables`. A file
  of an earlier version has no run table: its samples are one run under a new identity.

  Raises:
    ParameterValueError: the carried arrays are malformed.
  """
  keys = list(store.keys())
  rest = {k: store[k] for k in keys if k not in STORE_KEYS + (GROUPING_KEY, RUN_IDS_KEY)}
  if STORE_KEYS[0] not in keys:
    return rest, None
  samples, queries = (np.asarray(store[k], np.float64) for k in STORE_KEYS[:2])
  try:
    samples, queries = rec.validate_arrays(samples, queries)
  except ValueError as e:
    raise ParameterValueError(f"the ledger carried by the weights file is malformed: {e}") from None
  grouping = None
  if GROUPING_KEY in keys:
    try:
      grouping = ledger_file.check_grouping(
          np.asarray(store[GROUPING_KEY], np.uint8).tobytes().decode("ascii"), "weights file")
    except UnicodeDecodeError:
      raise ParameterValueError("the ledger carried by the weights file has a malformed "
                                f"{GROUPING_KEY!r}") from None
  passes = int(np.asarray(store[STORE_KEYS[2]]))
  table = run_ids.fresh(samples.shape[0], passes)
  if RUN_IDS_KEY in keys:
    try:
      entries = json.loads(np.asarray(store[RUN_IDS_KEY], np.uint8).tobytes().decode("ascii"))
    except (UnicodeDecodeError, json.JSONDecodeError):
      raise ParameterValueError("the ledger carried by the weights file has a malformed "
                                f"{RUN_IDS_KEY!r}") from None
    table = run_ids.check_table(entries, samples.shape[0], passes, "weights file")
  return rest, (samples, queries, passes, grouping, table)
