"""The privacy ledger of a DP optimizer in its Keras config, and supplying a ledger by hand.

Rule: every noised step ever taken is charged, so the ledger travels with the model.
The DP optimizer's `get_config` writes the ledger's signed dict (`ledger.to_dict()`, the file
format of `save_json`; McMahan et al., "A General Approach to Adding Differential Privacy to
Iterative Training Procedures", Section 6: the ledger records every sampling and query event
of the run) under "dp_ledger"; `from_config` verifies it and the new optimizer's ledger
starts from it. So `model.save` -> `keras.models.load_model` -> `fit` charges every step
taken before the save. A `tf.train.Checkpoint` of the optimizer carries the ledger as its
`_dp_ledger` dependency (a tf.Module, made by its `private_step`). A model restored without its ledger (optimizer
iterations > ledger samples) is refused by `fit` until `optimizer.restore_ledger(...)`
supplies it (ledger_callbacks.check_ledger_covers).

The config's digest is SHA-256: it detects accidental changes to a saved model's ledger, not
a deliberate edit (anyone can recompute a digest); keep the model file where it cannot be
edited, or export the ledger with `save_json(path, key=...)` for an HMAC.
"""

import os

import tensorflow as tf

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import ledger_file

CONFIG_KEY = "dp_ledger"


def check_counts(iterations, samples):
  """Refuses `iterations` optimizer steps charged by fewer than `iterations` ledger samples.

  Args:
    iterations: int, the optimizer's iterations (steps taken).
    samples: int, the ledger's samples.
  Returns:
    None.
  Raises:
    ValueError: samples < iterations (the message says how to supply the ledger).
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
  """`check_counts` on a DP optimizer, read eagerly (also while a tf.function is traced).

  Args:
    opt: a DP optimizer.
  Returns:
    None.
  Raises:
    ValueError: its iterations exceed its ledger's samples.
  """
  ledger = opt.private_step.existing_ledger
  if ledger is None:   # no sampling declared yet: the private step refuses to run anyway
    return
  with tf.init_scope():
    iterations = int(opt.iterations.numpy())
    samples = int(ledger.sample_count.numpy())
  check_counts(iterations, samples)


def arrays_of_config(d):
  """(samples, queries, passes) of a config's "dp_ledger" dict, verified (digest).

  Args:
    d: the signed ledger dict.
  Returns:
    the arrays and the pass count.
  Raises:
    ValueError: the dict is malformed or altered (names the config field).
  """
  try:
    return ledger_file.dict_to_arrays(d)
  except ValueError as e:
    raise ParameterValueError(f"the optimizer config's {CONFIG_KEY!r}: {e}") from None


def config_ledger(opt):
  """The signed dict of `opt`'s ledger (or of the one pending from from_config), else None.

  Args:
    opt: a DP optimizer.
  Returns:
    a ledger dict, or None when there is no ledger or it holds no sample and no pass.
  """
  pending = opt.private_step.state.restored_ledger
  ledger = opt.private_step.existing_ledger
  if ledger is None:
    return None if pending is None else ledger_file.arrays_to_dict(*pending[:2],
                                                                    passes=pending[2])
  if int(ledger.sample_count.numpy()) == 0 and int(ledger.passes.numpy()) == 0:
    return None
  return ledger.to_dict()


def restore_ledger(opt, ledger, key=None):
  """Replaces `opt`'s ledger content by the run's ledger (for a model restored without it).

  Args:
    opt: a DP optimizer.
    ledger: a PrivacyLedger, a signed ledger dict, or the path of a ledger JSON file
      (`PrivacyLedger.save_json`, `callbacks.LedgerExport`).
    key: the HMAC key the dict or file was signed with, or None (digest only).
  Returns:
    `opt.ledger`, now holding `ledger`'s samples and passes.
  Raises:
    ValueError: the file or dict is malformed or fails verification, or it holds fewer
      samples than the optimizer's iterations.
  """
  if hasattr(ledger, "get_arrays") and hasattr(ledger, "passes"):
    arrays = (*ledger.get_arrays(), int(ledger.passes.numpy()))
  elif isinstance(ledger, dict):
    arrays = ledger_file.dict_to_arrays(ledger, key)
  elif isinstance(ledger, (str, os.PathLike)):
    arrays = ledger_file.load(os.fspath(ledger), key)
  else:
    raise PrivacyConfigError(f"ledger must be a PrivacyLedger, a ledger dict or a ledger JSON path. "
                             f"Received: ledger={ledger!r}")
  iterations = int(opt.iterations.numpy())
  if arrays[0].shape[0] < iterations:
    raise PrivacyConfigError(f"the ledger holds {arrays[0].shape[0]} samples but the optimizer has "
                             f"taken iterations={iterations} steps: it is not this run's complete "
                             "ledger; supply the ledger written at or after the last step")
  opt.private_step.state.restored_ledger = None
  target = opt.private_step.ledger
  with tf.init_scope():
    target.set_arrays(*arrays)
  return target
