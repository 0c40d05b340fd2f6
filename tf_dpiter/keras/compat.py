"""TF Privacy spellings on tf_dpiter (migration aid; see docs/migration/tf_privacy.md).

  DPSequential(l2_norm_clip=..., noise_multiplier=..., num_microbatches=..., layers=...),
  make_dp_model_class(cls), DPKerasSGDOptimizer / ...Adam / ...Adagrad (tf_dpiter.keras's own)
  make_keras_optimizer_class(cls) (= make_dp_optimizer_class): the DP class of any Keras
      optimizer class, constructed with (l2_norm_clip, noise_multiplier, num_microbatches, ...)
  VectorizedDPKerasSGDOptimizer / ...AdamOptimizer / ...AdagradOptimizer
      the DP optimizers with clipping="vectorized" by default (TF Privacy's vectorized
      per-example gradients); any other `clipping` may still be given.
  compute_dp_sgd_privacy(n, batch_size, noise_multiplier, epochs, delta)
      unpacks as TF Privacy's `eps, opt_order`; also has .statement and .steps.
  compute_dp_sgd_privacy_statement(...)
      TF Privacy's statement, stating the relation and the unit of every number.
  compute_eps_poisson(epoch, noise_multi, n, batch_size, delta)
      TF Privacy's GDP accountant (its MovieLens tutorial): an APPROXIMATION (central
      limit theorem), not an upper bound; see accounting.gdp.

TF Privacy's custom-loop call `optimizer.minimize(loss, var_list, tape=tape)` works with
`model=` added (the Keras model that computed the per-example losses; without it the call
is refused). The privacy is the same as with the tf_dpiter names: these only choose defaults
and argument orders; every number comes from the same ledger path as `accounting.epsilon`.
"""

import warnings

import keras

from tf_dpiter import accounting
from tf_dpiter.keras.model import models
from tf_dpiter.keras.optimizer import optimizers

DPSequential = models.DPSequential
make_dp_model_class = models.make_dp_model_class
make_dp_optimizer_class = optimizers.make_dp_optimizer_class
make_keras_optimizer_class = optimizers.make_dp_optimizer_class
DPKerasSGDOptimizer = optimizers.DPKerasSGDOptimizer
DPKerasAdamOptimizer = optimizers.DPKerasAdamOptimizer
DPKerasAdagradOptimizer = optimizers.DPKerasAdagradOptimizer
compute_dp_sgd_privacy = accounting.compute_dp_sgd_privacy
compute_dp_sgd_privacy_statement = accounting.compute_dp_sgd_privacy_statement


def _vectorized(base, name):
  """Subclass of the DP optimizer `base` whose `clipping` defaults to "vectorized"."""

  def __init__(self, l2_norm_clip=None, noise_multiplier=None, num_microbatches=None, *args,
               clipping="vectorized", **kwargs):
    """TF Privacy's vectorized DP optimizer: the DP optimizer with clipping="vectorized".

    Args:
      l2_norm_clip: S, the per-record L2 clip.
      noise_multiplier: z, the noise standard deviation over S.
      num_microbatches: M (None: one example per record).
      *args: the Keras optimizer's own positional arguments.
      clipping: "vectorized" by default (per-example gradients by vectorized_map).
      **kwargs: the other DP arguments (DPOptimizerBase.__init__) and Keras' own.
    """
    base.__init__(self, l2_norm_clip, noise_multiplier, num_microbatches, *args,
                  clipping=clipping, **kwargs)

  cls = type(name, (base,), {
      "__init__": __init__,
      "__doc__": f"TF Privacy's {name}: {base.__name__} with clipping='vectorized' by default "
                 "(per-example gradients by vectorized_map).",
      "__module__": __name__,
  })
  return keras.saving.register_keras_serializable(package="tf_dpiter", name=name)(cls)


VectorizedDPKerasSGDOptimizer = _vectorized(optimizers.DPKerasSGDOptimizer,
                                            "VectorizedDPKerasSGDOptimizer")
VectorizedDPKerasAdamOptimizer = _vectorized(optimizers.DPKerasAdamOptimizer,
                                             "VectorizedDPKerasAdamOptimizer")
VectorizedDPKerasAdagradOptimizer = _vectorized(optimizers.DPKerasAdagradOptimizer,
                                                "VectorizedDPKerasAdagradOptimizer")


def compute_eps_poisson(epoch, noise_multi, n, batch_size, delta):
  """Epsilon by TF Privacy's GDP accountant (Poisson sampling, central limit theorem).

  mu = (batch_size / n) sqrt(T (e^(1 / noise_multi^2) - 1)) with T = ceil(epoch n /
  batch_size) steps (TF Privacy uses epoch n / batch_size unrounded), then the mu-GDP
  epsilon at delta. An approximation, not an upper bound: prefer
  `accounting.compute_dp_sgd_privacy(..., accountant="rdp")` or "pld" for a guarantee.

  Args:
    epoch: epochs E.
    noise_multi: the noise multiplier z.
    n: records.
    batch_size: the expected batch size B.
    delta: in (0, 1).

  Returns:
    the GDP epsilon, a float (an approximation: it can be below the true epsilon).

  Warns:
    UserWarning: on every call, naming the value as approximate (a float cannot carry the
      label) and the accountants that give a bound.
  """
  eps = accounting.compute_dp_sgd_privacy(n, batch_size, noise_multi, epoch, delta,
                                          accountant="gdp").epsilon
  warnings.warn(
      f"compute_eps_poisson: epsilon ~ {eps:.4g} at delta={delta:g} is TF Privacy's GDP value, "
      "an approximation (central limit theorem), not an upper bound; it can be below the true "
      "epsilon. For a guarantee use dp.accounting.compute_dp_sgd_privacy(n, batch_size, "
      "noise_multiplier, epochs, delta, accountant='pld') (or 'rdp')", UserWarning,
      stacklevel=2)
  return eps


__all__ = [
    "DPSequential", "make_dp_model_class", "make_dp_optimizer_class",
    "make_keras_optimizer_class", "DPKerasSGDOptimizer", "DPKerasAdamOptimizer",
    "DPKerasAdagradOptimizer", "VectorizedDPKerasSGDOptimizer", "VectorizedDPKerasAdamOptimizer",
    "VectorizedDPKerasAdagradOptimizer", "compute_dp_sgd_privacy",
    "compute_dp_sgd_privacy_statement", "compute_eps_poisson",
]
