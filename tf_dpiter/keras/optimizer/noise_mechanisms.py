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

The mechanism is built when the optimizer is built (it needs the trainable variables' shapes),
and its state (step, noise history / tree nodes / BLT buffers, and the noise generator's Philox
state) are optimizer variables: `model.save`, `tf.train.Checkpoint`, `save_weights` and
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
    raise ValueError(f"noise={noise!r}: {name} must be an integer >= 1, got {value!r}")
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
    raise ValueError(f"noise must be one of {NOISE_KINDS}, got {noise!r}")
  given = {k: v for k, v in params.items() if v is not None}
  extra = sorted(set(given) - set(_PARAMS[noise]))
  if extra:
    raise ValueError(f"noise={noise!r} takes no {extra[0]} (got {extra[0]}={given[extra[0]]!r}); "
                     f"its parameters are {sorted(_PARAMS[noise]) or 'none'}")
  if noise == "iid":
    return {}
  if dp_query is not None:
    raise ValueError(f"noise={noise!r} builds its own query; give it or dp_query={dp_query!r}, "
                     "not both")
  if secure_mode:
    raise ValueError(f"secure_mode=True applies to noise='iid' only, got noise={noise!r}")
  out = dict(_PARAMS[noise], **given)
  for name in ("restart_every", "num_bands", "num_steps", "num_buffers", "min_separation"):
    if name in out and out[name] is not None:
      _positive_int(name, out[name], noise)
  if noise == "tree" and out["restart_every"] is None:
    raise ValueError("noise='tree' needs restart_every (leaves per tree; the steps per "
                     "shuffled pass or a divisor of it), got restart_every=None")
  if noise == "band_mf":
    if out["num_bands"] is None:
      raise ValueError("noise='band_mf' needs num_bands (1 = DP-SGD), got num_bands=None")
    if out["num_bands"] > 1 and out["num_steps"] is None:
      raise ValueError(f"noise='band_mf' with num_bands={out['num_bands']} needs num_steps "
                       "(the training steps the strategy is optimized for), got None")
    if out["band_strategy"] not in band_mf_query.STRATEGIES:
      raise ValueError(f"band_strategy must be one of {band_mf_query.STRATEGIES}, got "
                       f"{out['band_strategy']!r}")
  if noise == "blt" and out["num_steps"] is None:
    raise ValueError("noise='blt' needs num_steps (the horizon; later steps are refused), "
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
    raise ValueError(
        f"noise={noise!r} with {what}={params[what]!r} is accounted only under sampling "
        f"policy {needed!r}" + (f" with at least {least} groups" if least else "")
        + f" ({hint}); got policy {policy!r}, sample_size {sample_size!r}")
  if noise == "tree":
    per_pass = math.ceil(float(population_size) / float(sample_size))
    if per_pass % params["restart_every"]:
      raise ValueError(
          f"noise='tree' with restart_every={params['restart_every']}: the ledger charges one "
          f"tree per shuffled pass, so every tree must end at a pass boundary; a pass here is "
          f"ceil(n / B) = ceil({population_size:g} / {float(sample_size):g}) = {per_pass} "
          f"steps, which restart_every must divide (e.g. restart_every={per_pass})")


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
  raise ValueError(f"make_query builds the correlated mechanisms, got noise={noise!r}")


class _Unbuilt:
  """Stands for a correlated query until the optimizer is built (any use raises)."""

  def __init__(self, noise):
    self.noise = noise

  def __getattr__(self, name):
    raise ValueError(
        f"noise={self.noise!r}: the mechanism is made when the optimizer is built on the model's "
        "trainable variables (model.fit does it; or call optimizer.build(model.trainable_"
        "variables) first)")


class NoiseMechanismMixin:
  """The optimizer side of `noise=`: builds the query on `build`, keeps its state (and its
  generator's) in optimizer variables, checks the declared sampling (module docstring).

  A base of `optimizers.DPOptimizerMixin`, before `mechanism.MechanismMixin` in the MRO.
  """

  def _dp_init_noise(self, noise, params, dp_query, secure_mode):
    """Stores the validated mechanism (check_noise_args; raises its ValueError)."""
    self._dp_noise_params = check_noise_args(noise, params, dp_query, secure_mode)
    self._dp_noise = noise
    self._dp_pending_sampling = None

  @property
  def noise(self):
    """The noise mechanism: "iid", "tree", "band_mf" or "blt"."""
    return self._dp_noise

  @property
  def noise_params(self):
    """The mechanism's parameters, defaults filled in (a copy; {} for "iid")."""
    return dict(self._dp_noise_params)

  def noise_state(self):
    """The correlated query's current global state as numpy values (a namedtuple: step,
    noise history / tree nodes / BLT buffers, clip and stddev); None before it exists.

    Returns:
      the state, or None for "iid" or before the optimizer is built.
    """
    if self._dp_noise == "iid" or self._dp_global_vars is None:
      return None
    return tf.nest.pack_sequence_as(self._dp_global_struct,
                                    [v.numpy() for v in self._dp_global_vars])

  def pending_query(self):
    """A placeholder for the query while a declared sampling waits for `build` (any use of
    it raises, naming what to do), else None.

    Returns:
      the placeholder or None.
    """
    if getattr(self, "_dp_pending_sampling", None) is None:
      return None
    return _Unbuilt(self._dp_noise)

  def noise_config(self):
    """The config entries of the mechanism.

    Returns:
      {"noise": ..., its parameters}; {} for "iid", so its config is unchanged.
    """
    if self._dp_noise == "iid":
      return {}
    return dict({"noise": self._dp_noise}, **self._dp_noise_params)

  def _make_dp_state(self):
    if self._dp_noise != "iid" and self._dp_base_query is None:
      self._dp_base_query = _Unbuilt(self._dp_noise)   # replaced in build
    super()._make_dp_state()

  def set_sampling(self, population_size, selection_probability, policy="poisson",
                   sample_size=0):
    """`MechanismMixin.set_sampling`, after checking that the ledger can account the
    mechanism under this sampling (check_sampling). Before the optimizer is built, a
    correlated mechanism keeps the declaration and applies it in `build`.

    Args:
      population_size, selection_probability, policy, sample_size: as
        MechanismMixin.set_sampling.

    Returns:
      True when the recorded policy or record unit changed (or the declaration waits).

    Raises:
      ValueError: see check_sampling and MechanismMixin.set_sampling.
    """
    check_sampling(self._dp_noise, self._dp_noise_params, policy, population_size, sample_size)
    self._dp_check_tree_boundary()
    if self._dp_noise != "iid" and not self.built:
      self._dp_pending_sampling = (population_size, selection_probability, policy, sample_size)
      self._dp_sampling_source = "user"
      return True
    return super().set_sampling(population_size, selection_probability, policy, sample_size)

  def _dp_check_tree_boundary(self):
    """A (re)declared sampling starts new shuffled passes: refuses it inside a tree, where a
    tree would span two passes (one example twice in it; the per-pass accounting would not
    cover that)."""
    state = self.noise_state() if self._dp_noise == "tree" else None
    r = self._dp_noise_params.get("restart_every")
    if state is not None and int(state.step) % r:
      raise ValueError(
          f"noise='tree' with restart_every={r}: the mechanism is at step {int(state.step)}, "
          "inside a tree, and a new sampling (a new fit or dataset) starts new passes: a tree "
          "would span two passes. Train in whole trees (steps_per_epoch a multiple of "
          "restart_every, whole passes)")

  def prepare_mechanism(self, variables):
    """Builds the optimizer on `variables` now when a correlated mechanism waits for their
    shapes (DPModel.fit calls it before the train step is traced); a no-op for "iid" or
    once built.

    Args:
      variables: the model's trainable variables.
    """
    if self._dp_noise != "iid" and not self.built:
      self.build(list(variables))

  def compute_private_gradients(self, loss_fn, variables, *args, **kwargs):
    """`CustomLoopMixin.compute_private_gradients`, building a correlated mechanism on
    `variables` first (prepare_mechanism).

    Args:
      loss_fn, variables, *args, **kwargs: as CustomLoopMixin.compute_private_gradients.
    Returns:
      the noised, averaged gradients, aligned with `variables`.
    """
    variables = list(variables)
    self.prepare_mechanism(variables)
    return super().compute_private_gradients(loss_fn, variables, *args, **kwargs)

  def minimize(self, loss, var_list, *args, **kwargs):
    """`CustomLoopMixin.minimize`, building a correlated mechanism on `var_list` first.

    Args:
      loss, var_list, *args, **kwargs: as CustomLoopMixin.minimize.
    Returns:
      as CustomLoopMixin.minimize.
    """
    var_list = list(var_list)
    self.prepare_mechanism(var_list)
    return super().minimize(loss, var_list, *args, **kwargs)

  def _require_query(self):
    if self._dp_pending_sampling is not None:
      raise ValueError(
          f"noise={self._dp_noise!r}: the sampling is declared but the mechanism is not built "
          "yet (it needs the trainable variables' shapes): call optimizer.build(model."
          "trainable_variables) before a custom loop or train_on_batch (model.fit does it)")
    return super()._require_query()

  def build(self, variables):
    """Keras' build, then (noise != "iid") the mechanism's query and state variables.

    Args:
      variables: the trainable variables the optimizer updates.
    """
    super().build(variables)
    if self._dp_noise != "iid":
      self._dp_build_mechanism(variables)

  def _dp_build_mechanism(self, variables):
    """Makes the query; its global state and generator state become optimizer variables
    (in a fixed order, so save_weights / load_weights match them by position)."""
    self._make_dp_state()
    with tf.init_scope():
      query = make_query(self._dp_noise, self._dp_noise_params, self._dp_l2_norm_clip,
                         self._dp_noise_multiplier, variables, seed=self._dp_seed)
      init = tf.nest.map_structure(tf.convert_to_tensor, query.initial_global_state())
      state_vars = [tf.Variable(t, trainable=False, name=f"dp_noise_state_{i}")
                    for i, t in enumerate(tf.nest.flatten(init))]
    for v in state_vars + [query.noise_generator.state]:
      self._track_variable(v)
    self._dp_base_query = query
    self._dp_global_struct = init
    self._dp_global_vars = state_vars
    if self._dp_pending_sampling is not None:
      pending, self._dp_pending_sampling = self._dp_pending_sampling, None
      source = self._dp_sampling_source
      super().set_sampling(*pending)
      self._dp_sampling_source = source
