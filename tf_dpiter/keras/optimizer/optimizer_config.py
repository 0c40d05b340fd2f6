"""The Keras config of a DP optimizer, and the arguments `from_budget` builds one from.

The config holds the private step's settings (S, z, M, P, clipping, normalize, seed,
secure_mode, the noise mechanism and its parameters), a custom dp_query serialized with its
current global state, and the ledger's signed dict (saved_ledger). It never holds the key
of the compiled noise draw (noise_draw): knowing it would let whoever sees the updates
subtract the noise.
"""

import keras

from tf_dpiter import dp_query as dp_query_lib
from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.optimizer import budget
from tf_dpiter.keras.optimizer import noise_mechanisms
from tf_dpiter.keras.optimizer import saved_ledger


def dp_config(opt):
  """The DP entries of `opt`'s Keras config: the settings, {"noise", its parameters} unless
  noise == "iid", "dp_query" and "dp_global_state" for a custom query, "dp_ledger" once the
  ledger holds a sample."""
  step = opt.private_step
  plan, flags = step.plan, step.flags
  config = {
      "l2_norm_clip": plan.l2_norm_clip,
      "noise_multiplier": plan.noise_multiplier,
      "num_microbatches": plan.num_microbatches,
      "max_physical_batch_size": flags.max_physical_batch_size,
      "clipping": flags.clipping,
      "normalize": plan.normalize,
      "seed": plan.seed,
      "ledger_journal": opt.ledger_journal,
      "secure_mode": plan.secure_mode,
  }
  mechanism = plan.noise
  if mechanism.name in noise_mechanisms.NOISE_KINDS:   # the shorthand and its flat keywords
    if mechanism.name != "iid":                        # "iid" adds nothing
      config.update(dict({"noise": mechanism.name}, **mechanism.flat_params()))
  else:   # one's own mechanism: {"class_name", "config"} (its class defined before loading)
    config["noise"] = noise_mechanisms.serialize(mechanism)
  for name, default in (("sampling", None), ("accountant", "rdp")):
    if getattr(plan, name) != default:
      config[name] = getattr(plan, name)
  if step.custom_query:
    # The default query's state is fixed by (S, z); a custom one's may adapt.
    config["dp_query"] = dp_query_lib.serialize(step.base_query)
    state = step.global_state_values()
    if state is not None:
      config["dp_global_state"] = state
  ledger = saved_ledger.config_ledger(opt)
  if ledger is not None:
    config["dp_ledger"] = ledger
  return config


def split_config(config, custom_objects=None):
  """(constructor config with the dp_query rebuilt, dp_global_state or None, the verified
  ledger's (samples, queries, passes) or None) of a get_config dict.

  Raises:
    ParameterValueError: a malformed or altered "dp_ledger" (saved_ledger.arrays_of_config).
  """
  config = dict(config)
  if isinstance(config.get("dp_query"), dict):
    config["dp_query"] = dp_query_lib.deserialize(config["dp_query"], custom_objects)
  state = config.pop("dp_global_state", None)
  ledger = config.pop("dp_ledger", None)
  if ledger is not None:
    ledger = saved_ledger.arrays_of_config(ledger)   # verified now: a bad one fails the load
  return config, state, ledger


def calibrated_arguments(class_name, epsilon, delta, epochs, batch_size, population_size,
                         sampling, accountant, args, kwargs):
  """(z, calibration dict, positional args, keyword args) for the constructor of `from_budget`,
  with z calibrated (budget.calibrated_noise); the arguments as DPOptimizerBase.from_budget.

  Raises:
    PrivacyConfigError: noise != "iid", a noise_multiplier or dp_query given, no l2_norm_clip.
  """
  kwargs = dict(kwargs)
  for name in ("dp_config", "plan"):
    if kwargs.get(name) is not None:
      raise PrivacyConfigError(f"from_budget builds the plan from its keywords: {name}="
                               f"{kwargs[name]!r} cannot be given (calibrate, then "
                               "dp_config.replace(noise_multiplier=z))")
  noise = kwargs.get("noise", "iid")
  if noise != "iid" and not isinstance(noise, noise_mechanisms.IID):
    raise PrivacyConfigError(f"from_budget calibrates DP-SGD (noise='iid'), got noise="
                             f"{getattr(noise, 'name', noise)!r}; calibrate a correlated mechanism with its own "
                             "accounting (dp.accounting on its ledger)")
  for name in ("noise_multiplier", "dp_query"):
    if kwargs.get(name) is not None:
      raise PrivacyConfigError(f"from_budget calibrates the noise: {name}={kwargs[name]!r} cannot "
                               "be given")
  if kwargs.get("l2_norm_clip") is None:
    raise PrivacyConfigError("from_budget needs l2_norm_clip=... (the clipping norm S); the noise "
                             "multiplier is calibrated")
  z, calib = budget.calibrated_noise(epsilon, delta, epochs, batch_size, population_size,
                                     sampling, accountant, kwargs.get("num_microbatches"),
                                     who=f"{class_name}.from_budget")
  positional = (kwargs.pop("l2_norm_clip"), z, kwargs.pop("num_microbatches", None)) + tuple(args)
  rest = {k: v for k, v in kwargs.items() if k not in ("noise_multiplier", "dp_query")}
  return z, calib, positional, rest


def check_ledger_journal(ledger_journal):
  """Checks the optimizer's ledger journal path: None or a non-empty file path string.

  Raises:
    ParameterValueError: anything else, named with its value.
  """
  if ledger_journal is not None and (not isinstance(ledger_journal, str) or not ledger_journal):
    raise ParameterValueError(validation.message("ledger_journal", "None or a file path",
                                                 ledger_journal))


def check_no_gradient_accumulation(steps):
  """Refuses Keras' gradient_accumulation_steps > 1 (None or 1: fine).

  Raises:
    PrivacyConfigError: steps > 1 (the message says what to do instead).
  """
  if steps is None or steps == 1:
    return
  raise PrivacyConfigError(
      f"gradient_accumulation_steps={steps!r} is not supported by DP optimizers: Keras would "
      "add noise and charge the ledger at every micro-step, and the k batches it accumulates "
      "are not one sample of the data (an example could be in several). For a large logical "
      "batch that does not fit in memory, sample it once (batch_size=B) and set "
      "max_physical_batch_size=P: the batch is processed in chunks of P examples, with one "
      "noise draw and one ledger sample per batch")


def constructor_config(optimizer):
  """The keyword arguments that rebuild a plain Keras `optimizer` (its get_config, a
  learning-rate schedule deserialized)."""
  config = dict(optimizer.get_config())
  lr = config.get("learning_rate")
  if isinstance(lr, dict):
    config["learning_rate"] = keras.optimizers.schedules.deserialize(lr)
  return config
