"""Keras 3 DP training: DP optimizers, DP models, privacy callbacks.

The optimizer wrappers of McMahan et al., "A General Approach to Adding Differential Privacy
to Iterative Training Procedures", Section 7 (a DPQuery clips and noises each logical
batch; the privacy ledger records every sample).

One way to do each thing (`__all__`):

  * a DP optimizer: `DPKerasSGDOptimizer`, `DPKerasAdamOptimizer`, `DPKerasAdamWOptimizer`,
    `DPKerasAdagradOptimizer`, `DPKerasRMSpropOptimizer` (TF Privacy's constructor
    arguments), `DPOptimizer(any_keras_optimizer, ...)` for any other optimizer, and
    `from_budget(optimizer, epsilon, delta, ...)` when the noise is to be calibrated to a
    budget;
  * a DP model: `DPSequential`, `DPModel` (functional), `make_private(model)` for any model,
    `make_private_with_epsilon(model, optimizer, epsilon, delta, ...)` (Opacus' spelling: the
    model and a calibrated optimizer), `private_class(cls)` before loading a saved subclassed
    model, `declare_per_example(layer_or_class, reason)` for a custom layer that acts on each
    example alone (else `clipping="auto"` runs each example alone: the vectorized path);
  * the DP plan as a value: `DPConfig` (clip, noise mechanism, sampling policy, accountant;
    frozen, validated once; `DPKerasSGDOptimizer(dp_config=...)`), `PerformanceFlags` (chunk
    size, clipping path, compiled noise) and the mechanisms of `noise` (`noise.BLT(...)`,
    `noise.BandMF(...)`, `noise.Tree(...)`, `noise.IID()`);
  * callbacks: `PrivacyMeter`, `LedgerJournal` and the module `callbacks`
    (`StopAtPrivacyBudget`, `LedgerExport`);
  * recipes: `DPKerasAdamBCOptimizer` (Tang et al., bias-corrected DP Adam),
    `augmentation_multiplicity(model, augment_fn, k)` (De et al. 2022, Section 3.1),
    `layers.Scattering2D` (ScatterNet features, Tramèr and Boneh 2021), and the averaging
    callbacks `callbacks.ExponentialMovingAverage` / `callbacks.PolyakAveraging`;
  * modules: `fast_clipping` (ghost norms), `layers`, `example_models`, `compat` (TF
    Privacy's spellings).

Names kept working for existing code but not listed (see `compat`): `make_dp_model_class`,
`make_dp_optimizer_class`, `DPOptimizerMixin`, `DPModelMixin`, `check_no_batch_mixing`,
`CLIPPING_MODES`, and the `Vectorized*` optimizers.
"""

import importlib
import sys

import keras

from tf_dpiter.keras import callbacks
from tf_dpiter.keras import compat
from tf_dpiter.keras import example_models
from tf_dpiter.keras import fast_clipping
from tf_dpiter.keras import layers
from tf_dpiter.keras import noise
from tf_dpiter.keras.callbacks import LedgerJournal
from tf_dpiter.keras.callbacks import PrivacyMeter
from tf_dpiter.keras.fast_clipping.rules import keras_hub as _keras_hub_rules
from tf_dpiter.keras.internals import per_example as _per_example
from tf_dpiter.keras.layers import scattering as _scattering
from tf_dpiter.keras.model.augmentation import augmentation_multiplicity
from tf_dpiter.keras.model.models import DPModel
from tf_dpiter.keras.model.models import DPSequential
from tf_dpiter.keras.model.models import make_private
from tf_dpiter.keras.model.models import make_private_with_epsilon
from tf_dpiter.keras.model.models import private_class
from tf_dpiter.keras.internals.per_example import declare_per_example
from tf_dpiter.keras.optimizer.adam_bc import DPKerasAdamBCOptimizer
from tf_dpiter.keras.optimizer.dp_config import DPConfig
from tf_dpiter.keras.optimizer.dp_config import PerformanceFlags
from tf_dpiter.keras.optimizer.optimizers import DPKerasAdagradOptimizer
from tf_dpiter.keras.optimizer.optimizers import DPKerasAdamOptimizer
from tf_dpiter.keras.optimizer.optimizers import DPKerasAdamWOptimizer
from tf_dpiter.keras.optimizer.optimizers import DPKerasRMSpropOptimizer
from tf_dpiter.keras.optimizer.optimizers import DPKerasSGDOptimizer
from tf_dpiter.keras.optimizer.optimizers import DPOptimizer

__all__ = [
    "DPKerasSGDOptimizer", "DPKerasAdamOptimizer", "DPKerasAdamWOptimizer",
    "DPKerasAdagradOptimizer", "DPKerasRMSpropOptimizer", "DPOptimizer", "from_budget",
    "DPSequential", "DPModel", "make_private", "make_private_with_epsilon", "private_class",
    "PrivacyMeter", "LedgerJournal", "callbacks", "fast_clipping", "example_models", "compat",
    "DPKerasAdamBCOptimizer", "augmentation_multiplicity", "layers", "declare_per_example",
    "DPConfig", "PerformanceFlags", "noise",
]

def _library_per_example_classes():
  """The library's own layers that act per example (fixed filters: `layers.Scattering2D`)."""
  return (_scattering.Scattering2D,)


def _keras_hub_rule_classes():
  """The keras_hub classes with a ghost-norm rule (`fast_clipping.rules.keras_hub.RULES`)
  whose module the user imported (keras_hub is never imported here)."""
  for module_name, rules in _keras_hub_rules.RULES.items():
    module = sys.modules.get(module_name)
    if module is not None:
      yield from (getattr(module, class_name, None) for class_name in rules)


# The lowest sub-package (`internals`) learns the per-example classes the upper ones define
# from here, the package root, so that it imports none of them.
_per_example.add_class_source(_library_per_example_classes)
_per_example.add_class_source(_keras_hub_rule_classes)


# Older spellings: still resolve (existing code and saved models), not part of `__all__`.
_KEPT = {
    "make_dp_model_class": "tf_dpiter.keras.model.models",
    "make_dp_optimizer_class": "tf_dpiter.keras.optimizer.optimizers",
    "DPOptimizerMixin": "tf_dpiter.keras.optimizer.optimizers",
    "DPModelMixin": "tf_dpiter.keras.model.models",
    "check_no_batch_mixing": "tf_dpiter.keras.model.models",
    "CLIPPING_MODES": "tf_dpiter.keras.optimizer.optimizers",
    "VectorizedDPKerasSGDOptimizer": "tf_dpiter.keras.compat",
    "VectorizedDPKerasAdamOptimizer": "tf_dpiter.keras.compat",
    "VectorizedDPKerasAdagradOptimizer": "tf_dpiter.keras.compat",
}


def from_budget(optimizer, epsilon, delta, epochs, batch_size, population_size, l2_norm_clip,
                sampling="poisson", accountant="rdp", **dp_kwargs):
  """A DP copy of `optimizer` whose noise multiplier the accountant calibrated to a budget.

  z is the smallest noise multiplier for which ceil(epochs n / B) DP-SGD steps at sampling
  rate q = B / n, under `sampling`, give epsilon <= the target at `delta` (dp-accounting's RDP
  or PLD accountant inverted by bisection; McMahan et al. 2018, Section 4). Train with the
  same batch size, epochs and sampling: the ledger then reports epsilon <= the target. The
  calibration is logged (logger "tf_dpiter", INFO) and kept in `optimizer.calibration`.
  Privacy unit: one example; relation: add/remove one example under "poisson", replace one
  under "shuffle" and "fixed_size".

  Args:
    optimizer: a plain `keras.optimizers.Optimizer` instance (its hyperparameters are kept;
      this form also lets Adam keep its own `epsilon`).
    epsilon: the target epsilon (> 0).
    delta: the target delta (in (0, 1)).
    epochs: E, the number of passes over the data.
    batch_size: B, the expected batch size.
    population_size: n, the number of examples.
    l2_norm_clip: the clipping norm S of each example's gradient.
    sampling: "poisson" (default), "shuffle" or "fixed_size".
    accountant: "rdp" (default) or "pld".
    **dp_kwargs: other DP optimizer arguments (num_microbatches, clipping, ...).

  Returns:
    a DP optimizer (an instance of the DP class of `type(optimizer)`).

  Raises:
    ParameterValueError: a DP or non-Keras optimizer.
    BudgetConfigError: a target the calibration refuses.
  """
  from tf_dpiter.keras.optimizer import budget_copy  # pylint: disable=g-import-not-at-top
  return budget_copy.dp_copy_for_budget(optimizer, epsilon, delta, epochs, batch_size,
                                        population_size, l2_norm_clip, sampling, accountant,
                                        dp_kwargs, who="dp.keras.from_budget")


def __getattr__(name):
  if name in _KEPT:
    return getattr(importlib.import_module(_KEPT[name]), name)
  raise AttributeError(f"module 'tf_dpiter.keras' has no attribute {name!r}")
