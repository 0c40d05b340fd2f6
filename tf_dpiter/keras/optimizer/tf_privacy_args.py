"""TF Privacy's spelling of a DP model: the DP settings on the model, not the optimizer.

TF Privacy writes `DPSequential(l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=None,
layers=[...])` (and `make_dp_model_class(keras.Model)`), then compiles with a plain Keras
optimizer. `TFPrivacyArgsMixin` accepts those arguments (by keyword, or positionally in TF
Privacy's order) and, at `compile`, turns the plain optimizer into its DP copy
(`optimizers.DPOptimizer`) with these settings: the same private step, noise and ledger as
a DP optimizer given directly. `use_xla=True` maps to Keras' `jit_compile=True`;
`layer_registry` (TF Privacy's fast-clipping registry) is refused: tf_dpiter picks the fast
path itself (`clipping="auto"`) and takes new layers through
`dp.keras.fast_clipping.register_layer`.
"""

import numbers

import keras

from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.optimizer import optimizers as opt_lib

_NAMES = ("l2_norm_clip", "noise_multiplier", "num_microbatches", "use_xla", "layer_registry")


def _is_number(v):
  return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _positional(args):
  """TF Privacy's leading positional arguments: (settings dict, remaining args)."""
  out, args = {}, list(args)
  if len(args) < 2 or not (_is_number(args[0]) and _is_number(args[1])):
    return out, args
  out["l2_norm_clip"], out["noise_multiplier"] = args.pop(0), args.pop(0)
  looks_like = [lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
                lambda v: isinstance(v, bool), lambda v: v is None]
  for name, test in zip(_NAMES[2:], looks_like):
    if not args or not test(args[0]):
      break
    out[name] = args.pop(0)
  return out, args


class TFPrivacyArgsMixin:
  """Accepts TF Privacy's DP model arguments (see module docstring)."""

  def __init__(self, *args, **kwargs):
    """TF Privacy's DP model arguments, then the Keras model's own.

    Args:
      *args: TF Privacy's (l2_norm_clip, noise_multiplier, num_microbatches=None,
        use_xla=None, layer_registry=None) by position, then the Keras model's own.
      **kwargs: the same by keyword, and the Keras model's own keyword arguments.

    Raises:
      ParameterTypeError: a DP argument given both by position and by keyword.
      PrivacyConfigError: a layer_registry (tf_dpiter chooses the fast path itself and takes
        new layers through dp.keras.fast_clipping.register_layer), or only one of
        l2_norm_clip and noise_multiplier.
    """
    settings, args = _positional(args)
    for name in _NAMES:
      if name in kwargs:
        if name in settings:
          raise ParameterTypeError(f"{type(self).__name__} got multiple values for argument {name!r}")
        settings[name] = kwargs.pop(name)
    if settings.get("layer_registry") is not None:
      raise PrivacyConfigError(
          f"layer_registry={settings['layer_registry']!r} is TF Privacy's fast-clipping "
          "registry; tf_dpiter chooses the fast path itself (clipping='auto') and takes new "
          "layers through dp.keras.fast_clipping.register_layer. Pass layer_registry=None")
    if settings and ("l2_norm_clip" not in settings or "noise_multiplier" not in settings):
      raise PrivacyConfigError(
          "l2_norm_clip and noise_multiplier go together (TF Privacy's DP model arguments); "
          f"got {sorted(settings)}")
    super().__init__(*args, **kwargs)
    self._dp_tfp_settings = settings or None

  def _dp_private_optimizer(self, optimizer, compile_kwargs):
    """The optimizer to compile with: DPOptimizer(optimizer, settings) when the model was
    given TF Privacy's settings, else `optimizer` unchanged."""
    settings = getattr(self, "_dp_tfp_settings", None)
    if not settings:
      return optimizer
    optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, opt_lib.DPOptimizerBase):
      raise PrivacyConfigError(
          f"{type(self).__name__} was given l2_norm_clip={settings['l2_norm_clip']!r} and "
          f"noise_multiplier={settings['noise_multiplier']!r} (TF Privacy's spelling) and "
          f"compiled with a DP optimizer ({type(optimizer).__name__}): give the DP settings "
          "in one place (a plain Keras optimizer here, or no settings on the model)")
    if settings.get("use_xla") and "jit_compile" not in compile_kwargs:
      compile_kwargs["jit_compile"] = True
    return opt_lib.DPOptimizer(optimizer, settings["l2_norm_clip"], settings["noise_multiplier"],
                               settings.get("num_microbatches"))
