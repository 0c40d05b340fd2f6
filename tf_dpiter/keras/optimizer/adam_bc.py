"""Bias-corrected DP Adam: Tang, Panda, Cheng and Lécuyer, "DP-AdamBC: Your DP-Adam Is Actually
DP-SGD (Unless You Apply Bias Correction)" (AAAI 2024), Section 4, Algorithm 1.

A DP optimizer hands Adam the noised average g~_t = (sum of clipped records + N(0, sigma^2 I)) / B,
so E[g~_t^2] = E[g_t^2] + Phi per coordinate with the noise variance Phi = (sigma / B)^2
= (z S / B)^2. Adam's second moment then estimates mostly Phi and its update degenerates into
SGD with a rescaled learning rate. DP-AdamBC subtracts Phi from the bias-corrected second moment:

    m_t = b1 m_{t-1} + (1 - b1) g~_t,      v_t = b2 v_{t-1} + (1 - b2) g~_t^2,
    m^_t = m_t / (1 - b1^t),               v^_t = v_t / (1 - b2^t),
    theta_t = theta_{t-1} - lr m^_t / (eps + sqrt(max(v^_t - Phi, gamma'))).

gamma' > 0 (`variance_floor`) keeps the root defined. Privacy: this is post-processing of the
noised gradients; Phi is computed from public quantities only (z, S and the public
denominator B of the DP step), so the guarantee and the ledger are those of the DP step.

`AdamBC(noise_variance=Phi, ...)` is the plain Keras optimizer with a given Phi (in squared
gradient units). `DPKerasAdamBCOptimizer(l2_norm_clip, noise_multiplier, ...)` (the DP class of
AdamBC, `make_dp_optimizer_class(AdamBC)`) sets Phi = (z S / B)^2 itself at every step, with
B the denominator its DP step divides by: the expected batch size q n (q n / b under cyclic
Poisson), the batch size under shuffle / fixed_size (a partial last batch is divided by its
own size there, so Phi is underestimated on that step), 1 with normalize=False.
"""

import keras
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.optimizer import optimizers

DEFAULT_VARIANCE_FLOOR = 1e-8


@keras.saving.register_keras_serializable(package="tf_dpiter", name="AdamBC")
class AdamBC(keras.optimizers.Adam):
  """Adam whose second moment has the per-coordinate noise variance Phi removed (module doc)."""

  def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
               noise_variance=None, variance_floor=DEFAULT_VARIANCE_FLOOR, name="adam_bc",
               **kwargs):
    """Args:
      learning_rate, beta_1, beta_2, epsilon: as keras.optimizers.Adam (epsilon is added to
        sqrt(max(v^ - Phi, gamma'))).
      noise_variance: Phi >= 0, the variance of the noise on each coordinate of the gradients
        this optimizer receives (squared gradient units), e.g. (z S / B)^2. None: set by the DP
        step (only for the DP class, DPKerasAdamBCOptimizer).
      variance_floor: gamma' > 0, the floor of v^ - Phi.
      name, **kwargs: as keras.optimizers.Adam (amsgrad is not supported).

    Raises:
      ParameterValueError: a negative or non-finite Phi, gamma' <= 0, amsgrad=True, or Phi=None on a
        non-DP AdamBC.
    """
    if kwargs.pop("amsgrad", False):
      raise ParameterValueError("`amsgrad` is not supported by AdamBC (Tang et al. define the bias "
                                "correction for Adam). Received: amsgrad=True")
    super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2,
                     epsilon=epsilon, name=name, **kwargs)
    if noise_variance is None:
      if not isinstance(self, optimizers.DPOptimizerMixin):
        raise PrivacyConfigError("`noise_variance` must be a number >= 0 for a non-DP AdamBC (use "
                                 "dp.keras.DPKerasAdamBCOptimizer to have it set from z, S and B). "
                                 "Received: noise_variance=None")
    elif not (float(noise_variance) >= 0 and float(noise_variance) < float("inf")):
      raise PrivacyConfigError("`noise_variance` must be a finite number >= 0 (Phi = (z S / B)^2). "
                               f"Received: noise_variance={noise_variance!r}")
    if not float(variance_floor) > 0 or float(variance_floor) == float("inf"):
      raise ParameterValueError("`variance_floor` must be a finite number > 0 (gamma'). "
                                f"Received: variance_floor={variance_floor!r}")
    self.noise_variance = None if noise_variance is None else float(noise_variance)
    self.variance_floor = float(variance_floor)

  def _noise_variance(self):
    """Phi as a float32 scalar tensor: the given one, or (z S / B)^2 from the DP step."""
    if self.noise_variance is not None:
      return tf.constant(self.noise_variance, tf.float32)
    return dp_noise_variance(self)

  def update_step(self, gradient, variable, learning_rate):
    """One DP-AdamBC step of `variable` (module docstring, Algorithm 1).

    Args:
      gradient: the noised average gradient of `variable`.
      variable: the variable updated.
      learning_rate: the step size at this iteration.
    """
    dtype = variable.dtype
    lr = tf.cast(learning_rate, dtype)
    gradient = tf.cast(gradient, dtype)
    step = tf.cast(self.iterations + 1, dtype)
    b1, b2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
    m = self._momentums[self._get_variable_index(variable)]
    v = self._velocities[self._get_variable_index(variable)]
    self.assign_add(m, (gradient - m) * (1 - b1))
    self.assign_add(v, (tf.square(gradient) - v) * (1 - b2))
    m_hat = m / (1 - tf.pow(b1, step))
    v_hat = v / (1 - tf.pow(b2, step))
    corrected = tf.maximum(v_hat - tf.cast(self._noise_variance(), dtype),
                           tf.cast(self.variance_floor, dtype))
    self.assign_sub(variable, lr * m_hat / (tf.sqrt(corrected) + tf.cast(self.epsilon, dtype)))

  def get_config(self):
    """Keras config with noise_variance and variance_floor."""
    config = super().get_config()
    config.pop("amsgrad", None)
    config.update({"noise_variance": self.noise_variance, "variance_floor": self.variance_floor})
    return config


def dp_noise_variance(opt):
  """Phi = (sigma / B)^2 of a DP optimizer's noised average, a float32 scalar tensor.

  sigma = z S for the default query (the `stddev` of a custom Gaussian-type dp_query); B the
  denominator of its DP step (module docstring).

  Args:
    opt: a tf_dpiter DP optimizer.

  Returns:
    the float32 tensor Phi.

  Raises:
    PrivacyConfigError: correlated noise (noise != "iid": the per-step noise is not N(0, sigma^2)
      i.i.d.), microbatches, or a custom dp_query without a `stddev`.
  """
  if opt.noise != "iid":
    raise PrivacyConfigError("DP-AdamBC needs i.i.d. Gaussian noise per step (Phi = (z S / B)^2); "
                             f"correlated noise has another per-step variance. Received: noise={opt.noise!r}")
  if opt.num_microbatches is not None:
    raise PrivacyConfigError("DP-AdamBC sets Phi from the per-example denominator; microbatches "
                             f"divide by another count. Received: num_microbatches={opt.num_microbatches!r}")
  step = opt.private_step
  step.make_state()   # the DP state: the query and the denominator variable
  stddev = getattr(step.base_query, "stddev", None)
  if stddev is None:
    raise PrivacyConfigError(f"dp_query={step.base_query!r} has no `stddev`: give AdamBC "
                             "noise_variance=Phi explicitly")
  denom = step.expected_records.read_value() if step.normalize else tf.constant(1.0)
  return tf.square(tf.cast(stddev, tf.float32) / tf.maximum(denom, 1.0))


DPKerasAdamBCOptimizer = optimizers.make_dp_optimizer_class(AdamBC)
