"""White-box Dirac gradient canaries inside the real DP-SGD train step (Nasr et al., "Tight
Auditing of Differentially Private Machine Learning", Section 4).

Canary k's gradient is s_k S e_k: zero but in its own coordinate w_k of an extra canary
weight vector w in R^m (no real record touches w, and w does not change predictions), of
norm exactly the clip S. It goes through the unmodified private step of a `tf_dpiter.keras`
DP model. With plain SGD (rate eta) and Poisson sampling (denominator q n), in units of S:

    x_kt = -(w_k^{t+1} - w_k^t) q n / (eta S) = s_k b_kt + N(0, z^2),  b_kt ~ Bernoulli(q),  (4)

independent over k and t (b_kt = 0 for canaries "out"), so `bounds.epsilon_lower_bound`
applies. Encoding (sparse labels, K classes): canary k of sign +1 has label K + k, of sign -1
K + m + k, input all zeros; the wrapped model outputs concat(base logits, w) and
`DiracCanaryLoss` gives canary rows s_k S w_k.
"""

import keras
import numpy as np
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.keras.model import models as dp_models

ADD_REMOVE = "add_remove"
REPLACE = "replace"
NEIGHBOURING = (ADD_REMOVE, REPLACE)
_P_IN = validation.Interval(float, 0, 1, closed="neither", error=ParameterValueError)


@keras.saving.register_keras_serializable(package="tf_dpiter.auditing")
class DiracCanaryModel(keras.Model):
  """base model + m canary weights; output concat(base(x), w) of shape [B, K + m].

  Args:
    base: a Keras model mapping x to logits [B, K] (built or buildable on x).
    num_canaries: m >= 1, one weight per canary.

  Raises:
    ParameterValueError: num_canaries not a positive integer.
  """

  def __init__(self, base, num_canaries, **kwargs):
    super().__init__(**kwargs)
    validation.check_integer("num_canaries", num_canaries, 1)
    self.base = base
    self.num_canaries = int(num_canaries)
    self.canary_weights = self.add_weight(shape=(self.num_canaries,), initializer="zeros",
                                          name="canary_weights", trainable=True)

  def call(self, x, training=False):
    """The base model's logits [B, K] concatenated with w broadcast to [B, m].

    Args:
      x: the base model's input batch.
      training: passed to the base model.

    Returns:
      a tensor [B, K + m].
    """
    logits = self.base(x, training=training)
    batch = tf.shape(logits)[0]
    w = tf.broadcast_to(tf.cast(self.canary_weights, logits.dtype)[None, :],
                        tf.stack([batch, self.num_canaries]))
    return tf.concat([logits, w], axis=-1)


@keras.saving.register_keras_serializable(package="tf_dpiter.auditing")
class DiracCanaryLoss(keras.losses.Loss):
  """Per-example loss: base loss on real rows, s_k · S · w_k on canary rows (Eq. 4).

  Args:
    num_classes: K, the base model's number of logits.
    num_canaries: m.
    l2_norm_clip: S, the DP optimizer's clipping norm (the canary gradient's L2 norm).
    from_logits: the base loss is sparse categorical cross-entropy on logits (True) or
      probabilities (False).
    reduction: Keras' loss reduction.
    name: the loss' name.
  """

  def __init__(self, num_classes, num_canaries, l2_norm_clip, from_logits=True,
               reduction="sum_over_batch_size", name="dirac_canary_loss"):
    super().__init__(reduction=reduction, name=name)
    self.num_classes = int(num_classes)
    self.num_canaries = int(num_canaries)
    self.l2_norm_clip = float(l2_norm_clip)
    self.from_logits = bool(from_logits)

  def call(self, y_true, y_pred):
    """Per-example loss [B]: the base loss on real rows, s_k · S · w_k on canary rows (Eq. 4).

    Args:
      y_true: sparse labels [B] (canary encoding in the module docstring).
      y_pred: the wrapped model's outputs [B, K + m].

    Returns:
      a float tensor [B].
    """
    y = tf.cast(tf.reshape(y_true, [-1]), tf.int32)
    k_cls, m = self.num_classes, self.num_canaries
    is_canary = y >= k_cls
    logits = y_pred[:, :k_cls]
    safe_y = tf.where(is_canary, tf.zeros_like(y), y)
    base = keras.losses.sparse_categorical_crossentropy(safe_y, logits,
                                                        from_logits=self.from_logits)
    idx = tf.where(is_canary, (y - k_cls) % m, tf.zeros_like(y))
    sign = tf.where(y >= k_cls + m, -1.0, 1.0)
    w = tf.gather(y_pred[:, k_cls:], idx, axis=1, batch_dims=1)
    canary = tf.cast(sign * self.l2_norm_clip, w.dtype) * w
    return tf.where(is_canary, tf.cast(canary, base.dtype), base)

  def get_config(self):
    """Keras serialization: the constructor's arguments."""
    return {"num_classes": self.num_classes, "num_canaries": self.num_canaries,
            "l2_norm_clip": self.l2_norm_clip, "from_logits": self.from_logits,
            "reduction": self.reduction, "name": self.name}


def draw_membership(num_canaries, seed, p_in=0.5):
  """Which canaries are "in" (sign +1 / present): independent Bernoulli(p_in), drawn before training.

  Args: num_canaries m >= 1; seed (int, reproducible audit design, not the DP noise);
  p_in in (0, 1). Returns: bool array [m]. Raises: ValueError for p_in outside (0, 1).
  """
  validation.check_params({"p_in": _P_IN}, {"p_in": p_in})
  return np.random.default_rng(seed).random(int(num_canaries)) < p_in


def canary_records(x_shape, num_classes, included, neighbouring=ADD_REMOVE, dtype=np.float32):
  """(x [r, *x_shape] zeros, y [r] int64 labels in [0, K)) of the canary records to append to
  the training set, `included` the bool [m] of `draw_membership`: under "add_remove" only
  included canaries are records (sign +1, r = #included); under "replace" every canary is a
  record (r = m; sign +1 if included, -1 if not; neighbours differ by a record's value,
  sensitivity 2S).

  Raises:
    PrivacyConfigError: unknown neighbouring.
  """
  validation.check_one_of("neighbouring", neighbouring, NEIGHBOURING, PrivacyConfigError)
  included = np.asarray(included, bool)
  m = included.size
  k = np.arange(m)
  y = (num_classes + k[included] if neighbouring == ADD_REMOVE
       else np.where(included, num_classes + k, num_classes + m + k))
  x = np.zeros((y.size,) + tuple(x_shape), dtype)
  return x, y.astype(np.int64)


def wrap_model(base, num_canaries):
  """The DP canary model `tf_dpiter.keras.make_private(DiracCanaryModel(base, num_canaries))`
  of the user's Keras model x -> logits [B, K] and m = num_canaries >= 1 canaries (compile
  it with a DP SGD optimizer).

  Raises:
    ParameterTypeError: num_canaries not an int; ValueError: num_canaries < 1.
  """
  return dp_models.make_private(DiracCanaryModel(base, num_canaries))


def check_optimizer(optimizer, model=None):
  """ValueError unless the released update of w is Eq. (4): plain DP SGD, vectorized clipping.

  Args: optimizer: the model's DP optimizer; model: the canary model (for the clipping mode).
  Raises: ValueError naming the offending setting.
  """
  if not isinstance(optimizer, keras.optimizers.SGD):
    raise ParameterValueError(f"white-box canaries need a DP SGD optimizer (update = -lr * gradient), got "
                              f"{type(optimizer).__name__}")
  if float(optimizer.momentum) != 0.0 or optimizer.weight_decay:
    raise ParameterValueError(f"white-box canaries need momentum=0 and no weight_decay, got "
                              f"momentum={optimizer.momentum!r}, weight_decay={optimizer.weight_decay!r}")
  if optimizer.num_microbatches is not None:
    raise PrivacyConfigError("white-box canaries need num_microbatches=None (one record per example), "
                             f"got {optimizer.num_microbatches!r}")
  if model is not None and optimizer.private_step.resolve_clipping(model) != "vectorized":
    raise PrivacyConfigError("white-box canaries need clipping='vectorized' (the canary weights are not "
                             f"a layer fast clipping knows), got clipping={optimizer.clipping!r}")
