"""Client side of Draw and Discard: Algorithm 1 of Pihur et al. 2018 (Section III-B).

    G = clip_[-c, c]( 1/N_c sum_i (Y-hat_i - Y_i) X_i )          (Eq. 3, clipped per weight)
    B' = B - gamma * G + Laplace(0, 2 gamma c / epsilon)          (per weight: feature-level LDP)

Features and responses are expected in [0, 1] (ModelSpec.featurize does the features).
`client_update` is vectorized over M clients at once; `tf_client_update` is the same step
for one client as a tf.function (an on-device TF client).
"""

from __future__ import annotations

import math

import numpy as np

from tf_dpiter import validation
from tf_dpiter.draw_discard import calibration
from tf_dpiter.draw_discard import glm
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError


def laplace_noise(rng: np.random.Generator, scale: float, shape) -> np.ndarray:
  """float64 Laplace(0, scale) samples of `shape` (scale b in weight units) from the numpy
  generator, as scale (E1 - E2), E1, E2 ~ Exp(1) iid (exact; ~3x faster than
  Generator.laplace)."""
  return scale * (rng.standard_exponential(shape) - rng.standard_exponential(shape))


def make_noise(rng: np.random.Generator, noise: str, gamma: float, epsilon: float | None,
               clip: float, shape, delta: float = 1e-6) -> np.ndarray | None:
  """Client noise of Algorithm 1, float64 of `shape` from the numpy generator: Laplace(2 gamma
  c / epsilon) (noise "laplace") or the Gaussian of Section IV-B at `delta` ("gaussian"),
  gamma the learning rate, c the per-coordinate clip, epsilon per update (nats); None for
  "none" or epsilon None.

  Raises:
    PrivacyConfigError: for an unknown noise law or a bad parameter.
  """
  if noise == "none" or epsilon is None:
    return None
  if noise == "laplace":
    return laplace_noise(rng, calibration.laplace_scale(gamma, epsilon, clip), shape)
  if noise == "gaussian":
    return rng.normal(0.0, calibration.noise_std("gaussian", gamma, epsilon, clip, delta), size=shape)
  raise PrivacyConfigError(f"noise must be 'laplace', 'gaussian' or 'none', got {noise!r}")


def clipped_gradient(family: str, weights: np.ndarray, x: np.ndarray, y: np.ndarray,
                     clip: float = 1.0, outputs: int = 1,
                     mask: np.ndarray | None = None) -> np.ndarray:
  """||G||_[-c, c] for M clients: Eq. (3)'s average gradient clipped per coordinate (Algorithm 1).

  A coordinate that is NaN (a NaN or infinite response, or an overflow inf - inf) counts as
  0: the sensitivity 2 gamma c of the update then holds for every input, where a NaN would
  pass through the noise and tell the server, without noise, that the client's data holds a
  non-finite value.

  Args:
    family: the GLM family.
    weights: [M, p*C] flat instances.
    x: [M, N_c, p] features in [0, 1].
    y: [M, N_c] responses.
    clip: c (> 0).
    outputs: C (classes for multinomial, else 1).
    mask: [M, N_c] of 0/1 for clients with fewer records, or None.

  Returns:
    [M, p*C] float64.

  Raises:
    PrivacyConfigError: for clip <= 0.
  """
  validation.check_positive("clip", clip, allow_inf=True)
  weights = np.asarray(weights, dtype=np.float64)
  x = np.asarray(x, dtype=np.float64)
  p = x.shape[-1]
  w = glm.weights_matrix(weights, p, outputs)
  with np.errstate(invalid="ignore", over="ignore"):
    g = glm.average_gradient(family, w, x, y, mask)
  np.clip(g, -clip, clip, out=g)
  g[np.isnan(g)] = 0.0  # |G_j| <= c for every input: see the docstring
  return g.reshape(weights.shape)


def client_update(weights: np.ndarray, x: np.ndarray, y: np.ndarray, *, family: str,
                  gamma: float, epsilon: float | None, clip: float = 1.0, outputs: int = 1,
                  noise: str = "laplace", delta: float = 1e-6,
                  rng: np.random.Generator | None = None,
                  mask: np.ndarray | None = None) -> np.ndarray:
  """Algorithm 1 for M clients at once: B' = B - gamma*||G||_[-c,c] + noise.

  Args:
    weights: [M, p*C] drawn instances, or [p*C] for one client.
    x: [M, N_c, p] features in [0, 1] ([N_c, p] for one client).
    y: [M, N_c] responses.
    family: the GLM family.
    gamma: the learning rate (> 0).
    epsilon: per-update epsilon (nats), or None (no noise: the paper's non-private runs).
    clip: c.
    outputs: C.
    noise: "laplace", "gaussian" or "none".
    delta: delta of the Gaussian calibration.
    rng: noise generator (default: fresh OS entropy).
    mask: [M, N_c] of 0/1, or None.

  Returns:
    The updated instances, the shape of `weights`.

  Raises:
    ParameterValueError: for gamma <= 0, epsilon <= 0, clip <= 0 or an unknown noise law.
  """
  validation.check_positive("gamma", gamma, allow_inf=True, error=ParameterValueError)
  if epsilon is not None:
    validation.check_positive("epsilon", epsilon, allow_inf=True)
  weights = np.asarray(weights, dtype=np.float64)
  if weights.ndim == 1:
    return client_update(weights[None], np.asarray(x)[None], np.asarray(y)[None], family=family,
                         gamma=gamma, epsilon=epsilon, clip=clip, outputs=outputs, noise=noise,
                         delta=delta, rng=rng,
                         mask=None if mask is None else np.asarray(mask)[None])[0]
  g = clipped_gradient(family, weights, x, y, clip, outputs, mask)
  out = weights - gamma * g
  rng = rng if rng is not None else np.random.default_rng()
  n = make_noise(rng, noise, gamma, epsilon, clip, out.shape, delta)
  if n is not None:
    out += n
  return out


def spec_update(spec: glm.ModelSpec, weights: np.ndarray, records, y,
                rng: np.random.Generator | None = None) -> np.ndarray:
  """Algorithm 1 for one client, with the model spec sent by the server (Section V-C).

  Args:
    spec: the served glm.ModelSpec (family, gamma, epsilon, clip, noise, delta).
    weights: [p*C] the drawn instance.
    records: the client's raw records (featurized by `spec`).
    y: [N_c] responses.
    rng: noise generator (default: fresh OS entropy).

  Returns:
    [p*C] float64, the update to submit.

  Raises:
    ParameterValueError: for a non-finite response, or features the spec refuses.
  """
  x = spec.featurize(records)
  y = np.asarray(y)
  if y.dtype.kind in "fc" and not np.all(np.isfinite(y)):
    raise ParameterValueError("`y` must hold finite responses (a NaN or infinite response is "
                              "not sent). Received: y with non-finite values")
  return client_update(np.asarray(weights, dtype=np.float64), x, np.asarray(y), family=spec.family,
                       gamma=spec.gamma, epsilon=spec.epsilon, clip=spec.clip,
                       outputs=spec.outputs, noise=spec.noise, delta=spec.delta, rng=rng)


# TensorFlow client (one client, inside tf.function)

def _tf_mean(family: str, eta):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if family == "linear":
    return eta
  if family == "logistic":
    return tf.sigmoid(eta)
  return tf.exp(tf.minimum(eta, 30.0)) if family == "poisson" else tf.nn.softmax(eta, axis=-1)


def make_tf_client_update(family: str, gamma: float, epsilon: float | None, clip: float = 1.0,
                          outputs: int = 1, noise: str = "laplace", delta: float = 1e-6,
                          generator=None):
  """Returns a tf.function update(weights [p*C], x [N_c, p], y [N_c]) -> B' (Algorithm 1).

  Noise comes from a Philox generator (dp_query.make_generator: OS entropy unless
  `generator` is given), sampled in float64 (`dp_query.laplace_noise` with dtype float64:
  float32 noise would expose the noiseless update's low bits, `randomness.exponential64`).

  Args:
    family: the GLM family.
    gamma: the learning rate (> 0).
    epsilon: per-update epsilon (nats), or None.
    clip: c (> 0).
    outputs: C.
    noise: "laplace", "gaussian" or "none".
    delta: delta of the Gaussian calibration.
    generator: a tf.random.Generator, a dp_query SecureRandom (Laplace noise only), or None.

  Returns:
    The tf.function update(weights, x, y) -> [p*C] float64.

  Raises:
    ParameterValueError: for an unknown family, gamma <= 0 or clip <= 0.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top  (lazy: the service needs no TF)
  glm.check_family(family)
  validation.check_positive("gamma", gamma, allow_inf=True, error=ParameterValueError)
  validation.check_positive("clip", clip, allow_inf=True)
  std = calibration.noise_std(noise, gamma, epsilon, clip, delta)
  scale = std / math.sqrt(2.0) if noise == "laplace" else std
  from tf_dpiter import dp_query  # pylint: disable=g-import-not-at-top
  gen = generator if generator is not None else dp_query.make_generator()

  @tf.function
  def update(weights, x, y):
    weights = tf.convert_to_tensor(weights, tf.float64)
    x = tf.cast(x, tf.float64)
    p = tf.shape(x)[-1]
    w = tf.reshape(weights, [p, outputs])
    mu = _tf_mean(family, tf.matmul(x, w))
    target = (tf.one_hot(tf.cast(y, tf.int32), outputs, dtype=tf.float64)
              if family == "multinomial" else tf.cast(y, tf.float64)[:, None])
    n = tf.cast(tf.shape(x)[0], tf.float64)
    g = tf.clip_by_value(tf.matmul(x, mu - target, transpose_a=True) / n, -clip, clip)
    g = tf.where(tf.math.is_nan(g), tf.zeros_like(g), g)  # as clipped_gradient: |G_j| <= c
    out = weights - gamma * tf.reshape(g, [-1])
    if std > 0:
      if noise == "laplace":
        out = out + dp_query.laplace_noise(gen, tf.shape(out), scale, dtype=tf.float64)
      else:
        out = out + gen.normal(tf.shape(out), stddev=scale, dtype=tf.float64)
    return out

  return update
