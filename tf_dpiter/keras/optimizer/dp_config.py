"""The DP plan of an optimizer as one frozen value (`dp.keras.DPConfig`), and the performance
choices kept out of it (`dp.keras.PerformanceFlags`).

McMahan et al., "A General Approach to Adding Differential Privacy to Iterative Training
Procedures" (2018), Section 2, separate what the privacy claim depends on from how the step
is computed. `DPConfig` holds the former (S, z, the noise mechanism, the record unit, the
normalization, the sampling policy, the accountant), validated once when made;
`PerformanceFlags` holds what changes a step's cost but not its output distribution.
"""

import dataclasses
import os
import sys
import warnings
from typing import Any, Optional

from tf_dpiter import dp_query as dp_query_lib
from tf_dpiter import validation
from tf_dpiter.accounting import accountants
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.optimizer import noise_mechanisms
from tf_dpiter.ledger import policies as ledger_policies

CLIPPING_MODES = ("auto", "vectorized", "fast")
# The start of the noise_multiplier=0 warning below, as a `warnings.filterwarnings` pattern: an
# internal probe that builds a noise-free optimizer on purpose (auditing.check_sensitivity)
# silences exactly this warning, so that it fires only for a user's own configuration.
NO_NOISE_WARNING = r"noise_multiplier=\S+: this DP optimizer adds no noise"


def _caller_level():
  """The warnings stacklevel of the first frame outside tf_dpiter and dataclasses' generated
  code (the user's line that made the plan or the optimizer)."""
  package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  frame, level = sys._getframe(2), 2   # pylint: disable=protected-access
  def internal(f):
    generated = (f.f_code.co_name == "__init__" and
                 type(f.f_locals.get("self")).__name__ in ("DPConfig", "PerformanceFlags"))
    return f.f_code.co_filename.startswith(package) or generated
  while frame is not None and internal(frame):
    frame, level = frame.f_back, level + 1
  return level


def _check_clip_and_noise(l2_norm_clip, noise_multiplier, dp_query):
  """S and z, or a custom dp_query (one of the two; each value is checked by
  DP_CONFIG_CONSTRAINTS), S = +inf only with z = 0, and the z = 0 warning."""
  if dp_query is not None:
    if l2_norm_clip is not None or noise_multiplier is not None:
      raise ParameterValueError(
          "give either `dp_query` or (`l2_norm_clip`, `noise_multiplier`), not both. Received: "
          f"l2_norm_clip={l2_norm_clip!r}, noise_multiplier={noise_multiplier!r}")
    return
  if l2_norm_clip is None or noise_multiplier is None:
    raise ParameterValueError(
        "`l2_norm_clip` and `noise_multiplier` are required without `dp_query`. Received: "
        f"l2_norm_clip={l2_norm_clip!r}, noise_multiplier={noise_multiplier!r}")
  z = float(noise_multiplier)
  validation.check_clip_norm("l2_norm_clip", l2_norm_clip, noise_multiplier=z)
  if z == 0:
    warnings.warn(
        f"noise_multiplier={noise_multiplier!r}: this DP optimizer adds no noise, so its "
        "training is NOT differentially private (the ledger reports epsilon = inf). Use "
        "noise_multiplier > 0 (about 1.0 is usual), or from_budget(epsilon, delta, ...) / "
        "make_private_with_epsilon to calibrate it; noise 0 is for tests only",
        UserWarning, stacklevel=_caller_level())


# The constraints of DPConfig's fields, each checked alone (`validation.check_params`); what
# depends on several fields (dp_query or (S, z); S = +inf only with z = 0; the mechanism's
# sampling and secure_mode) is checked in DPConfig.__post_init__.
DP_CONFIG_CONSTRAINTS = {
    "l2_norm_clip": validation.Optional(
        validation.Interval(float, 0, None, closed="neither", allow_inf=True), say_none=False),
    "noise_multiplier": validation.Optional(
        validation.Interval(float, 0, None, closed="left"), say_none=False),
    "num_microbatches": validation.Optional(validation.Integer(min=1)),
    "dp_query": validation.Optional(
        validation.InstanceOf(dp_query_lib.DPQuery, "a tf_dpiter DPQuery")),
    "sampling": validation.Optional(validation.OneOf(ledger_policies.names,
                                                     error=PrivacyConfigError)),
    "accountant": validation.OneOf(accountants.accountant_names, error=PrivacyConfigError),
}

PERFORMANCE_FLAGS_CONSTRAINTS = {
    "max_physical_batch_size": validation.Optional(validation.Integer(min=1)),
    "clipping": validation.OneOf(CLIPPING_MODES),
    "compiled_noise": validation.Optional(validation.InstanceOf(bool, "a bool")),
    "skip_padding_tail": validation.InstanceOf(bool, "a bool"),
}


@validation.validates(DP_CONFIG_CONSTRAINTS, also_raises=(ParameterValueError,))
@dataclasses.dataclass(frozen=True, kw_only=True)
class DPConfig:
  """What a DP optimizer's privacy claim depends on, validated once (final, immutable).

  Attributes:
    l2_norm_clip: S, the L2 clip of each record's gradient (loss-gradient units); None with
      a custom dp_query.
    noise_multiplier: z, the noise stddev over the sensitivity (the noise on a clipped sum of
      DP-SGD is N(0, (z S)^2)); None with a custom dp_query.
    noise: the noise mechanism (`dp.keras.noise.IID()`, `Tree`, `BandMF`, `BLT`, or one's
      own final NoiseMechanism); a name of dp.keras.noise's shorthands with no parameter
      ("iid") is accepted and replaced by its object.
    num_microbatches: M, microbatches per batch (a record is then ceil(B / M) examples,
      charged at sensitivity 2S; replace-one sampling only); None: one example per record.
    dp_query: a custom DPQuery whose result is a sum over records, instead of (S, z).
    normalize: divide the noised sum by the public denominator (else the sum is applied).
    seed: the noise generator's seed, tests only (not private).
    secure_mode: draw DP-SGD's noise from os.urandom (IID only; no seed, no dp_query).
    sampling: the sampling policy the run must declare (a registered ledger policy:
      `ledger.policies.names()`), or None for the one fit or set_sampling declares.
    accountant: the accountant `epsilon` uses: "rdp", "pld" or a name given to
      `dp.accounting.register_accountant`.
  """

  l2_norm_clip: Optional[float] = None
  noise_multiplier: Optional[float] = None
  noise: Any = dataclasses.field(default_factory=noise_mechanisms.IID)
  num_microbatches: Optional[int] = None
  dp_query: Any = None
  normalize: bool = True
  seed: Optional[int] = None
  secure_mode: bool = False
  sampling: Optional[str] = None
  accountant: str = "rdp"

  def __post_init__(self):
    """Checks what depends on several fields (each field alone: DP_CONFIG_CONSTRAINTS).

    Raises:
      ParameterTypeError: a non-numeric S or z, a non-integer M, a dp_query that is not a
        DPQuery, a noise that is not a mechanism (a TypeError, also a ValueError).
      PrivacyConfigError: S <= 0 or NaN, z < 0, NaN or infinite, S = inf with z > 0, a
        mechanism with a dp_query or secure_mode, a sampling the mechanism or the
        microbatches cannot be accounted under, an unknown accountant.
      ParameterValueError: M < 1, dp_query given with (S, z) or neither given, secure_mode
        with a dp_query or a seed.
    """
    _check_clip_and_noise(self.l2_norm_clip, self.noise_multiplier, self.dp_query)
    set_ = lambda name, value: object.__setattr__(self, name, value)
    if self.l2_norm_clip is not None:
      set_("l2_norm_clip", float(self.l2_norm_clip))
      set_("noise_multiplier", float(self.noise_multiplier))
    if isinstance(self.noise, str):
      set_("noise", noise_mechanisms.from_shorthand(self.noise))
    validation.check_instance("noise", self.noise, noise_mechanisms.NoiseMechanism,
                              "a dp.keras.noise mechanism")
    mech = self.noise
    if not isinstance(mech, noise_mechanisms.IID):
      if self.dp_query is not None:
        raise PrivacyConfigError(
            f"noise={mech.name!r} builds its own query; give it or dp_query={self.dp_query!r}, "
            "not both")
      if self.secure_mode:
        raise PrivacyConfigError(validation.message(
            "secure_mode", f"False with noise={mech.name!r} (os.urandom noise is noise='iid' "
            "only)", self.secure_mode))
    if self.secure_mode and (self.dp_query is not None or self.seed is not None):
      raise ParameterValueError("secure_mode applies to the default query and takes no seed; got "
                                f"dp_query={self.dp_query!r}, seed={self.seed!r}")
    set_("normalize", bool(self.normalize))
    set_("secure_mode", bool(self.secure_mode))
    if self.sampling is not None:
      needed, _ = mech.sampling_requirement()
      if needed is not None and needed != self.sampling:
        raise PrivacyConfigError(validation.message(
            "sampling", f"{needed!r} (or None) for {mech.describe()}", self.sampling))

  def __init_subclass__(cls, **kwargs):
    raise ParameterTypeError(f"DPConfig is final; {cls.__name__} cannot subclass it (compose it)")

  @property
  def custom_query(self):
    """True when a user's dp_query replaces (S, z)."""
    return self.dp_query is not None

  def replace(self, **changes):
    """A new, re-validated plan with `changes` (dataclasses.replace).

    Args:
      **changes: field name -> new value.

    Returns:
      a DPConfig.
    """
    return dataclasses.replace(self, **changes)

  def make_query(self, template=None):
    """The DPQuery of the plan: the custom dp_query, or the mechanism's (S, z) query.

    Args:
      template: the trainable variables' float32 TensorSpecs (mechanisms with
        needs_variables).

    Returns:
      a DPQuery.
    """
    if self.dp_query is not None:
      return self.dp_query
    return self.noise.make_query(self.l2_norm_clip, self.noise_multiplier, template,
                                 seed=self.seed, secure_mode=self.secure_mode)

  def epsilon(self, ledger, delta):
    """Epsilon of what `ledger` recorded, by this plan's accountant.

    Args:
      ledger: a PrivacyLedger (or what dp.accounting.epsilon takes).
      delta: in (0, 1).

    Returns:
      epsilon, a float.
    """
    from tf_dpiter.accounting import accountant  # pylint: disable=g-import-not-at-top
    return accountant.epsilon(ledger, delta, accountant=self.accountant)

  def get_config(self):
    """The plan as a JSON-able dict (`from_config` inverts it).

    Returns:
      dict: the fields, the mechanism as {"class_name", "config"}, a dp_query serialized
      (dp_query.serialize).
    """
    config = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    config["noise"] = noise_mechanisms.serialize(self.noise)
    if self.dp_query is not None:
      config["dp_query"] = dp_query_lib.serialize(self.dp_query)
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    """The plan of `get_config`'s dict.

    Args:
      config: the dict.
      custom_objects: for a serialized dp_query's Keras deserialization.

    Returns:
      a DPConfig.
    """
    config = dict(config)
    if "noise" in config:
      config["noise"] = noise_mechanisms.deserialize(config["noise"])
    if isinstance(config.get("dp_query"), dict):
      config["dp_query"] = dp_query_lib.deserialize(config["dp_query"], custom_objects)
    return cls(**config)


@validation.validates(PERFORMANCE_FLAGS_CONSTRAINTS)
@dataclasses.dataclass(frozen=True, kw_only=True)
class PerformanceFlags:
  """How a DP step is computed, not what it releases (final, immutable; checked by
  PERFORMANCE_FLAGS_CONSTRAINTS when made).

  Attributes:
    max_physical_batch_size: P, examples per physical chunk (gradient accumulation of one
      logical batch; one noise draw per batch); None: the whole batch at once.
    clipping: "auto" | "vectorized" | "fast" (the per-record norms' path).
    compiled_noise: True draws the noise inside a jit_compile=True program, False after
      it; None: inside on an accelerator only.
    skip_padding_tail: skip the all-padding chunks of a padded batch (False computes them).

  Raises:
    ParameterTypeError: a non-integer P, a non-bool flag.
    ParameterValueError: P < 1, an unknown clipping mode.
  """

  max_physical_batch_size: Optional[int] = None
  clipping: str = "auto"
  compiled_noise: Optional[bool] = None
  skip_padding_tail: bool = True

  def __init_subclass__(cls, **kwargs):
    raise ParameterTypeError(
        f"PerformanceFlags is final; {cls.__name__} cannot subclass it (compose it)")

  def replace(self, **changes):
    """New flags with `changes` (re-validated).

    Args:
      **changes: field name -> new value.

    Returns:
      PerformanceFlags.
    """
    return dataclasses.replace(self, **changes)

  def get_config(self):
    """The flags as a dict (`from_config` inverts it).

    Returns:
      dict of field name -> value.
    """
    return dataclasses.asdict(self)

  @classmethod
  def from_config(cls, config):
    """The flags of `get_config`'s dict.

    Args:
      config: the dict.

    Returns:
      PerformanceFlags.
    """
    return cls(**config)


_PLAN_DEFAULTS = {"l2_norm_clip": None, "noise_multiplier": None, "num_microbatches": None,
                  "dp_query": None, "normalize": True, "seed": None, "secure_mode": False,
                  "noise": "iid", "sampling": None, "accountant": "rdp"}


def plan_of_arguments(dp_config, plan, noise_params=None, **keywords):
  """The DPConfig of a DP optimizer's arguments: the given plan, or one built from the
  keywords (the Keras face: `DPKerasSGDOptimizer(l2_norm_clip=..., noise_multiplier=...)`).

  Args:
    dp_config: a DPConfig or None.
    plan: its alias, a DPConfig or None.
    noise_params: the flat noise keywords {restart_every, num_bands, ...} (None: not given).
    **keywords: the optimizer's privacy keywords (the DPConfig fields; `noise` may be a
      shorthand string).

  Returns:
    a DPConfig.

  Raises:
    PrivacyConfigError: a plan given with a privacy keyword or a flat noise keyword, or two
      different plans; see DPConfig and noise_mechanisms.from_shorthand.
    ParameterTypeError: dp_config/plan that is not a DPConfig.
  """
  if dp_config is not None and plan is not None and dp_config != plan:
    raise PrivacyConfigError(validation.message(
        "plan", f"left out, or equal to dp_config={dp_config!r} (an alias)", plan))
  given = dp_config if dp_config is not None else plan
  if given is None:
    keywords = dict(keywords)
    keywords["noise"] = noise_mechanisms.from_shorthand(keywords.get("noise", "iid"),
                                                        noise_params)
    return DPConfig(**keywords)
  validation.check_instance("dp_config", given, DPConfig, "a dp.keras.DPConfig")
  extra = {k: v for k, v in (noise_params or {}).items() if v is not None}
  extra.update({k: v for k, v in keywords.items()
                if k in _PLAN_DEFAULTS and v is not _PLAN_DEFAULTS[k]
                and v != _PLAN_DEFAULTS[k]})
  if extra:
    name = sorted(extra)[0]
    raise PrivacyConfigError(validation.message(
        name, "left out when dp_config= is given (the plan holds it: "
        f"dp_config.replace({name}=...))", extra[name]))
  return given


def flags_of_arguments(flags, max_physical_batch_size=None, clipping="auto"):
  """The PerformanceFlags of a DP optimizer's arguments.

  Args:
    flags: a PerformanceFlags or None.
    max_physical_batch_size: P (None: not given).
    clipping: the clipping mode ("auto": not given).

  Returns:
    PerformanceFlags.

  Raises:
    PrivacyConfigError: flags given with max_physical_batch_size or clipping.
    ParameterTypeError: flags that are not PerformanceFlags.
  """
  if flags is None:
    return PerformanceFlags(max_physical_batch_size=max_physical_batch_size, clipping=clipping)
  validation.check_instance("flags", flags, PerformanceFlags, "a dp.keras.PerformanceFlags")
  for name, value, default in (("max_physical_batch_size", max_physical_batch_size, None),
                               ("clipping", clipping, "auto")):
    if value != default:
      raise PrivacyConfigError(validation.message(
          name, f"left out when flags= is given (flags.replace({name}=...))", value))
  return flags
