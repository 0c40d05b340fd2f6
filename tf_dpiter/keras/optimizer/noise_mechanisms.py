"""The DP optimizers' choice of noise mechanism: `noise="iid" | "tree" | "band_mf" | "blt"`.

"iid" is DP-SGD (independent Gaussian noise z S per step; the default, unchanged). The others
add noise correlated across steps, through the queries of `tf_dpiter.dp_query`:

  "tree"    `TreeAggregationQuery` (DP-FTRL, Kairouz et al. 2021): `restart_every` R leaves
            per tree. Accounted under shuffled passes only, one tree per pass, so R must
            divide the steps per pass ceil(n / B) (every tree ends at a pass boundary).
  "band_mf" `BandMFQuery` (Choquette-Choo et al. 2023): `num_bands` b, optimized for
            `num_steps` n (required when b > 1); `band_strategy` "toeplitz" or "banded".
            b > 1 is accounted under cyclic Poisson sampling with >= b groups only
            (`dp.data.cyclic_poisson_batches(..., num_groups=b)`); b = 1 is DP-SGD.
  "blt"     `BLTQuery` (Dvijotham et al. 2024): `num_buffers`, horizon `num_steps` (steps
            beyond it are refused), `min_separation` b (default 1): cyclic Poisson with >= b
            groups only.

The mechanism is built when the optimizer is built (it needs the trainable variables'
shapes; `private_step.PrivateStep.build_mechanism`), and its state (step, noise history /
tree nodes / BLT buffers, and the noise generator's Philox state) are optimizer variables: `model.save`, `tf.train.Checkpoint`, `save_weights` and
`keras.callbacks.BackupAndRestore` keep them, so a resumed run draws the noise an
uninterrupted one would have. The sampling each mechanism needs comes from the ledger's own
rule (`ledger.records.correlated_requirement`), checked when the sampling is declared.
"""

import math

import tensorflow as tf

from tf_dpiter.dp_query import band_mf_query
from tf_dpiter.dp_query import blt_query
from tf_dpiter.dp_query import correlated_events
from tf_dpiter.dp_query import tree_aggregation_query
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import records

NOISE_KINDS = ("iid", "tree", "band_mf", "blt")
# Parameters each mechanism takes (name -> default); None: required (see check_noise_args).
_PARAMS = {
    "iid": {},
    "tree": {"restart_every": None},
    "band_mf": {"num_bands": None, "num_steps": None, "band_strategy": "toeplitz"},
    "blt": {"num_steps": None, "num_buffers": 4, "min_separation": 1},
}
PARAM_NAMES = ("restart_every", "num_bands", "num_steps", "band_strategy", "num_buffers",
               "min_separation")


def _positive_int(name, value, noise):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise PrivacyConfigError(f"noise={noise!r}: {name} must be an integer >= 1, got {value!r}")
  return value


def check_noise_args(noise, params, dp_query=None, secure_mode=False):
  """Validates the mechanism and its parameters; returns them with defaults filled in.

  Args:
    noise: one of NOISE_KINDS.
    params: {name: value} of PARAM_NAMES (None values count as not given).
    dp_query: the optimizer's dp_query argument (must be None unless noise == "iid").
    secure_mode: the optimizer's secure_mode (the correlated queries draw from Philox).

  Returns:
    dict of the mechanism's parameters (empty for "iid").

  Raises:
    ValueError: an unknown noise, a parameter the mechanism does not take, a missing or bad
      one (named with its value), or noise != "iid" with dp_query or secure_mode.
  """
  if noise not in NOISE_KINDS:
    raise PrivacyConfigError(f"noise must be one of {NOISE_KINDS}, got {noise!r}")
  given = {k: v for k, v in params.items() if v is not None}
  extra = sorted(set(given) - set(_PARAMS[noise]))
  if extra:
    raise PrivacyConfigError(f"noise={noise!r} takes no {extra[0]} (got {extra[0]}={given[extra[0]]!r}); "
                             f"its parameters are {sorted(_PARAMS[noise]) or 'none'}")
  if noise == "iid":
    return {}
  if dp_query is not None:
    raise PrivacyConfigError(f"noise={noise!r} builds its own query; give it or dp_query={dp_query!r}, "
                             "not both")
  if secure_mode:
    raise PrivacyConfigError(f"secure_mode=True applies to noise='iid' only, got noise={noise!r}")
  out = dict(_PARAMS[noise], **given)
  for name in ("restart_every", "num_bands", "num_steps", "num_buffers", "min_separation"):
    if name in out and out[name] is not None:
      _positive_int(name, out[name], noise)
  if noise == "tree" and out["restart_every"] is None:
    raise PrivacyConfigError("noise='tree' needs restart_every (leaves per tree; the steps per "
                             "shuffled pass or a divisor of it), got restart_every=None")
  if noise == "band_mf":
    if out["num_bands"] is None:
      raise PrivacyConfigError("noise='band_mf' needs num_bands (1 = DP-SGD), got num_bands=None")
    if out["num_bands"] > 1 and out["num_steps"] is None:
      raise PrivacyConfigError(f"noise='band_mf' with num_bands={out['num_bands']} needs num_steps "
                               "(the training steps the strategy is optimized for), got None")
    if out["band_strategy"] not in band_mf_query.STRATEGIES:
      raise ParameterValueError(f"band_strategy must be one of {band_mf_query.STRATEGIES}, got "
                                f"{out['band_strategy']!r}")
  if noise == "blt" and out["num_steps"] is None:
    raise PrivacyConfigError("noise='blt' needs num_steps (the horizon; later steps are refused), "
                             "got num_steps=None")
  return out


def requirement_event(noise, params):
  """The structural event the ledger's rule `records.correlated_requirement` judges, or None
  for "iid" (clip and stddev are placeholders: only the structure matters).

  Args:
    noise, params: as returned by check_noise_args.
  Returns:
    a correlated_events event, or None.
  """
  if noise == "tree":
    return correlated_events.TreeGaussianEvent(1.0, 1.0, params["restart_every"])
  if noise == "band_mf":
    return correlated_events.BandedGaussianEvent(1.0, 1.0, 1.0, params["num_bands"])
  if noise == "blt":
    return correlated_events.MatrixGaussianEvent(1.0, 1.0, 1.0, params["min_separation"])
  return None


def check_sampling(noise, params, policy, population_size, sample_size):
  """Refuses a sampling under which the ledger cannot account the mechanism.

  Args:
    noise, params: as returned by check_noise_args.
    policy, population_size, sample_size: the declared sampling (ledger.POLICIES; n; the
      batch size, or the number of groups b under cyclic_poisson).

  Raises:
    ValueError: the policy or its sample_size does not cover the mechanism (the ledger's
      rule), or a tree whose restart period does not divide the steps per shuffled pass.
  """
  event = requirement_event(noise, params)
  if event is None:
    return
  needed, least = records.correlated_requirement(event)
  what = {"tree": "restart_every", "band_mf": "num_bands", "blt": "min_separation"}[noise]
  if needed is not None and (policy != needed or float(sample_size) < least):
    hint = ("dp.data.shuffled_batches(x, y, batch_size=B) or fit(x, y, sampling='shuffle')"
            if needed == records.SHUFFLE else
            f"dp.data.cyclic_poisson_batches(x, y, expected_batch_size=B, num_groups>={least})")
    raise PrivacyConfigError(
        f"noise={noise!r} with {what}={params[what]!r} is accounted only under sampling "
        f"policy {needed!r}" + (f" with at least {least} groups" if least else "")
        + f" ({hint}); got policy {policy!r}, sample_size {sample_size!r}")
  if noise == "tree":
    per_pass = math.ceil(float(population_size) / float(sample_size))
    if per_pass % params["restart_every"]:
      raise PrivacyConfigError(
          f"noise='tree' with restart_every={params['restart_every']}: the ledger charges one "
          f"tree per shuffled pass, so every tree must end at a pass boundary; a pass here is "
          f"ceil(n / B) = ceil({population_size:g} / {float(sample_size):g}) = {per_pass} "
          f"steps, which restart_every must divide (e.g. restart_every={per_pass})")


def make_query_with_state(step, variables):
  """The step's correlated query on `variables` and its global state as new variables (in
  a fixed order: save_weights matches optimizer variables by position).

  Args:
    step: the PrivateStep (noise, noise_params, S, z, seed). variables: the trainable ones.
  Returns:
    (query, initial global state nest, list of its state variables).
  """
  with tf.init_scope():
    query = make_query(step.noise, step.noise_params, step.l2_norm_clip, step.noise_multiplier,
                       variables, seed=step.seed)
    init = tf.nest.map_structure(tf.convert_to_tensor, query.initial_global_state())
    state_vars = [tf.Variable(t, trainable=False, name=f"dp_noise_state_{i}")
                  for i, t in enumerate(tf.nest.flatten(init))]
  return query, init, state_vars


def make_query(noise, params, l2_norm_clip, noise_multiplier, variables, seed=None):
  """The correlated-noise DPQuery for `variables` (their shapes; sums kept in float32).

  Args:
    noise, params: as returned by check_noise_args (noise != "iid").
    l2_norm_clip, noise_multiplier: S and z.
    variables: the trainable variables the optimizer was built for.
    seed: tests only (not private).

  Returns:
    a TreeAggregationQuery, BandMFQuery or BLTQuery.

  Raises:
    ValueError: noise == "iid" or an unknown one.
  """
  template = [tf.TensorSpec(v.shape, tf.float32) for v in variables]
  if noise == "tree":
    return tree_aggregation_query.TreeAggregationQuery(
        l2_norm_clip, noise_multiplier, template, params["restart_every"], seed=seed)
  if noise == "band_mf":
    return band_mf_query.BandMFQuery(
        l2_norm_clip, noise_multiplier, template, num_bands=params["num_bands"],
        num_steps=params["num_steps"], strategy=params["band_strategy"], seed=seed)
  if noise == "blt":
    return blt_query.BLTQuery(
        l2_norm_clip, noise_multiplier, template, params["num_steps"],
        num_buffers=params["num_buffers"], min_separation=params["min_separation"], seed=seed)
  raise PrivacyConfigError(f"make_query builds the correlated mechanisms, got noise={noise!r}")


class Unbuilt:
  """Stands for a correlated query until the optimizer is built (any use raises)."""

  def __init__(self, noise):
    self.noise = noise

  def __getattr__(self, name):
    raise PrivacyConfigError(
        f"noise={self.noise!r}: the mechanism is made when the optimizer is built on the model's "
        "trainable variables (model.fit does it; or call optimizer.build(model.trainable_"
        "variables) first)")


def check_tree_boundary(noise, params, state):
  """Refuses a (re)declared sampling inside a tree: a new sampling starts new shuffled passes,
  and a tree spanning two passes would hold one example twice (the per-pass accounting of
  the ledger would not cover that).

  Args:
    noise, params: as returned by check_noise_args.
    state: the mechanism's current global state (`PrivateStep.noise_state()`), or None.
  Raises:
    ValueError: noise == "tree" and its step is not a multiple of restart_every.
  """
  if noise != "tree" or state is None:
    return
  r = params["restart_every"]
  if int(state.step) % r:
    raise PrivacyConfigError(
        f"noise='tree' with restart_every={r}: the mechanism is at step {int(state.step)}, "
        "inside a tree, and a new sampling (a new fit or dataset) starts new passes: a tree "
        "would span two passes. Train in whole trees (steps_per_epoch a multiple of "
        "restart_every, whole passes)")
