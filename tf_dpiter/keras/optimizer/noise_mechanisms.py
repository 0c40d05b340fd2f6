"""The DP optimizers' noise mechanisms as values: `dp.keras.noise.IID()`, `Tree(...)`,
`BandMF(...)`, `BLT(...)` (`noise="iid" | "tree" | "band_mf" | "blt"` with flat keywords are
shorthands: `from_shorthand`).

Each mechanism is a final, frozen dataclass owning its parameters (checked when made), the
DPQuery that draws its noise (`make_query`), the sampling its accounting needs
(`sampling_requirement`, `check_sampling`) and the structural event the ledger judges
(`requirement_event`). IID is DP-SGD (Abadi et al. 2016, Algorithm 1); Tree is DP-FTRL
(Kairouz et al. 2021, Section 3); BandMF (Choquette-Choo et al. 2023, Section 3); BLT
(Dvijotham et al. 2024, Section 4); each class names its paper and its sampling premise.
A correlated mechanism's query is made when the optimizer is built (`needs_variables`); its
state lives in variables the optimizer does not save (`private_step.PrivateStep.
build_mechanism`): the state is the noise of the released weights, so no model file or
checkpoint holds it, and a restored run resumes only through `PrivateStep.
restore_noise_state` (its file as secret as the data).
"""

import abc
import dataclasses
import math
from typing import ClassVar, Optional

import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import band_mf_query
from tf_dpiter.dp_query import blt_query
from tf_dpiter.dp_query import correlated_events
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import tree_aggregation_query
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import records

_REGISTRY = {}   # NoiseMechanism.name -> final class (shorthands and config tags)


class NoiseMechanism(abc.ABC):
  """A noise mechanism of a DP optimizer (abstract; every subclass is final).

  A subclass is a frozen dataclass with a class attribute `name` (its config tag and
  `noise=` shorthand), declares its fields' constraints (`validation.validates`), checks what
  depends on several fields in `__post_init__`, and defines `make_query`.
  Subclassing a concrete mechanism is refused (abstract-or-final).

  Class attributes:
    name: the tag of the mechanism in configs (and its `noise=` string for built-in ones).
    needs_variables: True if the query needs the trainable variables' shapes (made when the
      optimizer is built).
    correlated: True if the noise is correlated across steps (its state, the noise itself,
      is then kept out of every saved file; a rolled-back run, and a restored run without
      its noise state, are refused).
  """

  name: ClassVar[str] = ""
  needs_variables: ClassVar[bool] = True
  correlated: ClassVar[bool] = True
  # Legacy flat keyword -> field (the optimizer's `band_strategy` is BandMF's `strategy`).
  flat_names: ClassVar[dict] = {}

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    for base in cls.__mro__[1:]:
      if (base is not NoiseMechanism and isinstance(base, type)
          and issubclass(base, NoiseMechanism) and not getattr(base, "__abstractmethods__", ())):
        raise ParameterTypeError(
            f"{cls.__name__} subclasses the concrete mechanism {base.__name__}: mechanisms are "
            f"abstract or final. Subclass NoiseMechanism directly")
    if cls.name:
      old = _REGISTRY.get(cls.name)
      if old is not None and (old.__module__, old.__qualname__) != (cls.__module__,
                                                                     cls.__qualname__):
        raise PrivacyConfigError(
            f"`name` must be unique among noise mechanisms ({old.__qualname__} has it). "
            f"Received: name={cls.name!r}")
      _REGISTRY[cls.name] = cls

  @abc.abstractmethod
  def make_query(self, l2_norm_clip, noise_multiplier, template, seed=None, secure_mode=False):
    """The DPQuery that draws this mechanism's noise and returns its ledger events.

    Args:
      l2_norm_clip: S, the per-record L2 clip (loss-gradient units).
      noise_multiplier: z (noise stddev over the sensitivity).
      template: the float32 TensorSpecs of the trainable variables (None when
        `needs_variables` is False).
      seed: tests only (not private).
      secure_mode: draw from os.urandom (mechanisms that support it).

    Returns:
      a DPQuery whose result is the noised sum over records.
    """

  def requirement_event(self):
    """The structural privacy event of one step that the ledger's rule judges
    (`ledger.records.correlated_requirement`), clip and stddev set to 1 (only the structure
    matters); None for a mechanism accounted under any sampling.

    Returns:
      a correlated_events event, or None.
    """
    return None

  def sampling_requirement(self):
    """(policy, least sample_size) the ledger can account this mechanism under.

    Returns:
      (None, 0) for any sampling, else (a ledger policy, the fewest groups / batch size).
    """
    event = self.requirement_event()
    return (None, 0) if event is None else records.correlated_requirement(event)

  def describe(self):
    """`noise='blt' with min_separation=3`: how messages name the mechanism."""
    return f"noise={self.name!r}"

  def check_sampling(self, policy, population_size, sample_size, steps_per_pass=None):
    """Refuses a sampling under which the ledger cannot account the mechanism.

    Args:
      policy: the declared ledger policy (ledger.POLICIES).
      population_size: n, examples in the dataset.
      sample_size: the batch size (the number of groups under cyclic_poisson).
      steps_per_pass: the steps of one shuffled pass as the data makes them (a sampler's
        `steps_per_pass`: floor(n / B) with drop_remainder), or None when the data does not
        state it (then ceil(n / B) under "shuffle").

    Raises:
      PrivacyConfigError: the policy or its sample_size does not cover the mechanism.
    """
    del steps_per_pass   # only mechanisms with a per-pass structure read it (Tree)
    needed, least = self.sampling_requirement()
    if needed is None or (policy == needed and float(sample_size) >= least):
      return
    hint = ("dp.data.shuffled_batches(x, y, batch_size=B) or fit(x, y, sampling='shuffle')"
            if needed == records.SHUFFLE else
            f"dp.data.cyclic_poisson_batches(x, y, expected_batch_size=B, num_groups>={least})")
    raise PrivacyConfigError(
        f"{self.describe()} is accounted only under sampling policy {needed!r}"
        + (f" with at least {least} groups" if least else "")
        + f" ({hint}); got policy {policy!r}, sample_size {sample_size!r}")

  def check_boundary(self, state):
    """Refuses a new sampling declared at this point of the mechanism's state (none by
    default).

    Args:
      state: the mechanism's global state as numpy values, or None before it exists.
    """
    del state

  def get_config(self):
    """The mechanism's parameters, a JSON-able dict of field name -> value (`from_config` inverts
    it)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @classmethod
  def from_config(cls, config):
    """The mechanism of `get_config`'s dict.

    Args:
      config: dict of field name -> value.

    Returns:
      an instance of cls.
    """
    return cls(**config)

  def flat_params(self):
    """The optimizer's flat keywords for this mechanism, the `noise=` shorthand's ({} for IID)."""
    back = {field: flat for flat, field in self.flat_names.items()}
    return {back.get(k, k): v for k, v in self.get_config().items()}


def _count(why=None):
  """The constraint of a mechanism's count parameter: an int >= 1 (PrivacyConfigError), None
  allowed when `why` is None, else required (`why` says what it is)."""
  count = validation.Integer(min=1, error=PrivacyConfigError)
  return validation.Optional(count) if why is None else validation.Required(count, why)


@dataclasses.dataclass(frozen=True)
class IID(NoiseMechanism):
  """DP-SGD's independent Gaussian noise: N(0, sigma^2) per coordinate per step, sigma = z S
  (Abadi et al. 2016, Algorithm 1). No parameters; any sampling; the only mechanism that
  takes `secure_mode` or a custom `dp_query`."""

  name: ClassVar[str] = "iid"
  needs_variables: ClassVar[bool] = False
  correlated: ClassVar[bool] = False

  def make_query(self, l2_norm_clip, noise_multiplier, template, seed=None, secure_mode=False):
    """`GaussianSumQuery(S, z S)`, the stddev computed once in float64 (S and z are the plan's,
    validated by `DPConfig`)."""
    del template
    return gaussian_query.GaussianSumQuery(
        l2_norm_clip, gaussian_query.gaussian_stddev(l2_norm_clip, noise_multiplier,
                                                     validate=False),
        seed=seed, secure_mode=secure_mode)


@validation.validates({
    "restart_every": _count("leaves per tree: the steps per shuffled pass or a divisor of it")})
@dataclasses.dataclass(frozen=True)
class Tree(NoiseMechanism):
  """Online tree aggregation (DP-FTRL; Kairouz et al., "Practical and Private (Deep) Learning
  without Sampling or Shuffling", 2021, Section 3): accounted under shuffled passes only,
  one tree per pass.

  Attributes:
    restart_every: R, leaves per tree (the tree restarts every R steps); must divide the
      steps per shuffled pass (ceil(n / B), or floor(n / B) with drop_remainder: the
      sampler's steps_per_pass).

  Raises:
    ParameterTypeError: R is not an int.
    PrivacyConfigError: R is None or < 1.
  """

  restart_every: Optional[int] = None
  name: ClassVar[str] = "tree"

  def make_query(self, l2_norm_clip, noise_multiplier, template, seed=None, secure_mode=False):
    """A TreeAggregationQuery of R leaves per tree (Args as NoiseMechanism.make_query)."""
    del secure_mode
    return tree_aggregation_query.TreeAggregationQuery(
        l2_norm_clip, noise_multiplier, template, self.restart_every, seed=seed)

  def requirement_event(self):
    """A TreeGaussianEvent of tree_size R (shuffled passes only)."""
    return correlated_events.TreeGaussianEvent(1.0, 1.0, self.restart_every)

  def describe(self):
    return f"noise='tree' with restart_every={self.restart_every!r}"

  def check_sampling(self, policy, population_size, sample_size, steps_per_pass=None):
    """Shuffled passes, and R dividing the steps per pass (NoiseMechanism.check_sampling).

    The ledger charges one SingleEpochTreeAggregationDpEvent per shuffled pass (Kairouz et
    al. 2021, Section 3 and Appendix D: each example at most once per tree), sound only if
    every tree lies inside one pass: R must divide the steps of a pass as the data makes
    them, `steps_per_pass` when the data states it (floor(n / B) with drop_remainder), else
    ceil(n / B).

    Raises:
      PrivacyConfigError: another policy, or R not dividing the steps per pass (the message
        names restart_every, its value and the steps per pass).
    """
    super().check_sampling(policy, population_size, sample_size)
    if steps_per_pass is None:
      per_pass = math.ceil(float(population_size) / float(sample_size))
      what = (f"a pass here is ceil(n / B) = ceil({population_size:g} / "
              f"{float(sample_size):g}) = {per_pass} steps")
    else:
      validation.check_integer("steps_per_pass", steps_per_pass, 1, error=PrivacyConfigError)
      per_pass = int(steps_per_pass)
      what = f"a pass of this dataset is {per_pass} steps (its steps_per_pass)"
    if per_pass % self.restart_every:
      raise PrivacyConfigError(
          f"`restart_every` must divide the steps of a shuffled pass with noise='tree': the "
          f"ledger charges one tree per pass, so every tree must end at a pass boundary; "
          f"{what} (e.g. restart_every={per_pass}). Received: "
          f"restart_every={self.restart_every}")

  def check_boundary(self, state):
    """Refuses a new sampling inside a tree: a new sampling starts new shuffled passes, and a
    tree spanning two passes would hold one example twice.

    Args:
      state: the query's global state (numpy), or None.

    Raises:
      PrivacyConfigError: the mechanism's step is not a multiple of restart_every.
    """
    r = self.restart_every
    if state is not None and int(state.step) % r:
      raise PrivacyConfigError(
          f"noise='tree' with restart_every={r}: the mechanism is at step {int(state.step)}, "
          "inside a tree, and a new sampling (a new fit or dataset) starts new passes: a tree "
          "would span two passes. Train in whole trees (steps_per_epoch a multiple of "
          "restart_every, whole passes)")


@validation.validates({
    "num_bands": _count("the strategy's bands; 1 is DP-SGD"),
    "num_steps": _count(),
    "strategy": validation.OneOf(band_mf_query.STRATEGIES)}, also_raises=(PrivacyConfigError,))
@dataclasses.dataclass(frozen=True)
class BandMF(NoiseMechanism):
  """Banded matrix factorization (Choquette-Choo et al., "Correlated Noise Provably Beats
  Independent Noise for Differentially Private Learning", 2023, Section 3): b > 1 only under
  cyclic Poisson sampling with >= b groups; b = 1 is DP-SGD.

  Attributes:
    num_bands: b, bands of the strategy (1 = DP-SGD).
    num_steps: the training steps the strategy is optimized for (required when b > 1).
    strategy: "toeplitz" or "banded" (band_mf_query.STRATEGIES).

  Raises:
    ParameterTypeError: b or num_steps is not an int.
    PrivacyConfigError: b None or < 1, num_steps < 1, or None with b > 1.
    ParameterValueError: an unknown strategy.
  """

  num_bands: Optional[int] = None
  num_steps: Optional[int] = None
  strategy: str = "toeplitz"
  name: ClassVar[str] = "band_mf"
  flat_names: ClassVar[dict] = {"band_strategy": "strategy"}

  def __post_init__(self):
    """Requires num_steps when b > 1 (each field alone: the class's constraints)."""
    if self.num_bands > 1 and self.num_steps is None:
      raise PrivacyConfigError(validation.message(
          "num_steps", f"an int >= 1 with num_bands={self.num_bands} (the training steps the "
          "strategy is optimized for)", None))

  def make_query(self, l2_norm_clip, noise_multiplier, template, seed=None, secure_mode=False):
    """A BandMFQuery (Args as NoiseMechanism.make_query)."""
    del secure_mode
    return band_mf_query.BandMFQuery(
        l2_norm_clip, noise_multiplier, template, num_bands=self.num_bands,
        num_steps=self.num_steps, strategy=self.strategy, seed=seed)

  def requirement_event(self):
    """A BandedGaussianEvent of b bands (b > 1: cyclic Poisson with >= b groups)."""
    return correlated_events.BandedGaussianEvent(1.0, 1.0, 1.0, self.num_bands)

  def describe(self):
    return f"noise='band_mf' with num_bands={self.num_bands!r}"


@validation.validates({
    "num_steps": _count("the horizon; later steps are refused"),
    "num_buffers": _count("buffers of the strategy"),
    "min_separation": _count("steps between participations")})
@dataclasses.dataclass(frozen=True)
class BLT(NoiseMechanism):
  """Buffered linear Toeplitz noise (Dvijotham et al., "Efficient and Near-Optimal Noise
  Generation for Streaming Differential Privacy", 2024, Section 4): cyclic Poisson sampling
  with >= min_separation groups only.

  Attributes:
    num_steps: the horizon (steps beyond it are refused).
    num_buffers: buffers of the strategy (memory O(buffers d)).
    min_separation: b, the fewest steps between two participations of an example.

  Raises:
    ParameterTypeError: a parameter that is not an int.
    PrivacyConfigError: a parameter None or < 1.
  """

  num_steps: Optional[int] = None
  num_buffers: int = 4
  min_separation: int = 1
  name: ClassVar[str] = "blt"

  def make_query(self, l2_norm_clip, noise_multiplier, template, seed=None, secure_mode=False):
    """A BLTQuery (Args as NoiseMechanism.make_query)."""
    del secure_mode
    return blt_query.BLTQuery(
        l2_norm_clip, noise_multiplier, template, self.num_steps,
        num_buffers=self.num_buffers, min_separation=self.min_separation, seed=seed)

  def requirement_event(self):
    """A MatrixGaussianEvent of min_separation b (cyclic Poisson with >= b groups)."""
    return correlated_events.MatrixGaussianEvent(1.0, 1.0, 1.0, self.min_separation)

  def describe(self):
    return f"noise='blt' with min_separation={self.min_separation!r}"


NOISE_KINDS = ("iid", "tree", "band_mf", "blt")
PARAM_NAMES = ("restart_every", "num_bands", "num_steps", "band_strategy", "num_buffers",
               "min_separation")


def from_shorthand(noise, params=None):
  """The mechanism of `noise="blt"` and the optimizer's flat keywords.

  Args:
    noise: a NoiseMechanism (returned as is; then no params may be given), its `serialize`
      dict, or one of NOISE_KINDS.
    params: {flat keyword: value} of PARAM_NAMES (None values count as not given).

  Returns:
    a NoiseMechanism.

  Raises:
    PrivacyConfigError: an unknown noise, a keyword the mechanism does not take, or a bad
      parameter (named with its value).
  """
  given = {k: v for k, v in (params or {}).items() if v is not None}
  if isinstance(noise, dict):   # a config's {"class_name", "config"} (one's own mechanism)
    noise = deserialize(noise)
  if isinstance(noise, NoiseMechanism):
    if given:
      key = sorted(given)[0]
      raise PrivacyConfigError(
          f"`{key}` must not be given with noise={noise!r} (the object holds its parameters). "
          f"Received: {key}={given[key]!r}")
    return noise
  if noise not in NOISE_KINDS:
    raise PrivacyConfigError(validation.message(
        "noise", f"one of {NOISE_KINDS} or a dp.keras.noise mechanism object", noise))
  cls = _REGISTRY[noise]
  fields = {f.name for f in dataclasses.fields(cls)}
  takes = {flat for flat in PARAM_NAMES if cls.flat_names.get(flat, flat) in fields}
  extra = sorted(set(given) - takes)
  if extra:
    raise PrivacyConfigError(validation.message(
        extra[0], f"left out with noise={noise!r} (its parameters: {sorted(takes) or 'none'})",
        given[extra[0]]))
  return cls(**{cls.flat_names.get(k, k): v for k, v in given.items()})


def serialize(mechanism):
  """{"class_name": name, "config": get_config()} of a mechanism.

  Args:
    mechanism: a NoiseMechanism.

  Returns:
    a JSON-able dict.
  """
  return {"class_name": mechanism.name, "config": mechanism.get_config()}


def deserialize(config):
  """The mechanism of `serialize`'s dict (or of a shorthand string with no parameters).

  Args:
    config: a dict from `serialize`, a NoiseMechanism, or a name.

  Returns:
    a NoiseMechanism.

  Raises:
    PrivacyConfigError: an unknown mechanism name (its class is not defined in this process).
  """
  if isinstance(config, NoiseMechanism):
    return config
  if isinstance(config, str):
    return from_shorthand(config)
  name = config.get("class_name") if isinstance(config, dict) else None
  if name not in _REGISTRY:
    raise PrivacyConfigError(validation.message(
        "noise", f"a registered mechanism ({sorted(_REGISTRY)}; define the mechanism's class "
        "before loading)", config))
  return _REGISTRY[name].from_config(dict(config.get("config") or {}))


def make_query_with_state(mechanism, l2_norm_clip, noise_multiplier, variables, seed=None):
  """(query, initial global state nest, list of its state variables) of the mechanism on
  `variables` (sums kept in float32); the variables in a fixed order, since
  `save_noise_state` writes them by position (no model file holds them)."""
  with tf.init_scope():
    template = [tf.TensorSpec(v.shape, tf.float32) for v in variables]
    query = mechanism.make_query(l2_norm_clip, noise_multiplier, template, seed=seed)
    init = tf.nest.map_structure(tf.convert_to_tensor, query.initial_global_state())
    state_vars = [tf.Variable(t, trainable=False, name=f"dp_noise_state_{i}")
                  for i, t in enumerate(tf.nest.flatten(init))]
  return query, init, state_vars


class Unbuilt:
  """Stands for a correlated query until the optimizer is built (any use raises)."""

  def __init__(self, noise):
    """Args:
      noise: the mechanism's name (for the message)."""
    self.noise = noise

  def __getattr__(self, name):
    raise PrivacyConfigError(
        f"noise={self.noise!r}: the mechanism is made when the optimizer is built on the model's "
        "trainable variables (model.fit does it; or call optimizer.build(model.trainable_"
        "variables) first)")
