"""GLM mean, gradient and loss for Draw and Discard (Pihur et al. 2018, Section III-A, Eqs. 1 and 3).

E(Y) = g^-1(X B) with the canonical link of each family; the average gradient of the
negative log-likelihood is G = 1/N_c sum_i (Y-hat_i - Y_i) X_i for all four families.
Arrays are vectorized over clients: weights [..., p, C] (C = 1 but for multinomial).
Re-exported by `glm`.
"""

from __future__ import annotations

import numpy as np

from tf_dpiter.errors import ParameterValueError

FAMILIES = ("linear", "logistic", "poisson", "multinomial")

# exp() argument cap for the Poisson mean; keeps the gradient finite (it is clipped anyway).
_MAX_ETA = 30.0


def check_family(family: str) -> str:
  """`family` after checking it is one of FAMILIES.

  Raises:
    ParameterValueError: naming the family.
  """
  if family not in FAMILIES:
    raise ParameterValueError(f"family must be one of {FAMILIES}, got {family!r}")
  return family


# GLM mean, gradient and loss (vectorized over clients)

def weights_matrix(weights: np.ndarray, num_columns: int, outputs: int) -> np.ndarray:
  """[..., p*C] flat weights as [..., p, C] (p = num_columns, C = outputs; 1 for
  single-output families), a view when possible."""
  w = np.asarray(weights)
  return w.reshape(w.shape[:-1] + (num_columns, outputs))


def predict_mean(family: str, weights: np.ndarray, x: np.ndarray) -> np.ndarray:
  """Y-hat = g^-1(X B) (Eq. 1), [..., N, C] float64, of weights [..., p, C] and x [..., N, p]
  under the family's canonical link.

  Raises:
    ParameterValueError: for an unknown family.
  """
  check_family(family)
  eta = np.matmul(x, weights)
  if family == "linear":
    return eta
  if family == "logistic":
    return 1.0 / (1.0 + np.exp(-np.clip(eta, -_MAX_ETA, _MAX_ETA)))
  if family == "poisson":
    return np.exp(np.minimum(eta, _MAX_ETA))
  eta = eta - eta.max(axis=-1, keepdims=True)
  e = np.exp(eta)
  return e / e.sum(axis=-1, keepdims=True)


def response_matrix(family: str, y: np.ndarray, outputs: int) -> np.ndarray:
  """Y of responses y [..., N] as [..., N, C] float64: one-hot integer labels for
  multinomial, a trailing unit axis otherwise."""
  y = np.asarray(y)
  if family == "multinomial":
    return np.eye(outputs)[y.astype(np.int64)]
  return y[..., None].astype(np.float64)


def average_gradient(family: str, weights: np.ndarray, x: np.ndarray, y: np.ndarray,
                     mask: np.ndarray | None = None) -> np.ndarray:
  """Eq. (3) for a GLM, per client: G = 1/N_c sum_i (Y-hat_i - Y_i) X_i, [M, p, C] float64,
  of weights [M, p, C], x [M, N, p], y [M, N] (labels for multinomial) and mask [M, N] of
  0/1 (clients with fewer than N records; None: all present)."""
  outputs = weights.shape[-1]
  resid = predict_mean(family, weights, x) - response_matrix(family, y, outputs)
  if mask is None:
    n = x.shape[-2]
    return np.matmul(np.swapaxes(x, -1, -2), resid) / n
  mask = np.asarray(mask, dtype=np.float64)
  resid = resid * mask[..., None]
  n = np.maximum(mask.sum(axis=-1), 1.0)
  return np.matmul(np.swapaxes(x, -1, -2), resid) / n[..., None, None]


def mean_loss(family: str, weights: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
  """Average negative log-likelihood (squared error / 2 for linear) per record of one model
  [p, C] on x [N, p], y [N] (nats; squared units for linear)."""
  mu = predict_mean(family, weights, x)
  if family == "linear":
    return float(np.mean(0.5 * (mu[:, 0] - y) ** 2))
  if family == "logistic":
    p = np.clip(mu[:, 0], 1e-12, 1 - 1e-12)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
  if family == "poisson":
    eta = np.minimum(np.matmul(x, weights)[:, 0], _MAX_ETA)
    return float(np.mean(np.exp(eta) - y * eta))
  p = np.clip(mu[np.arange(len(y)), np.asarray(y, dtype=np.int64)], 1e-12, None)
  return float(-np.mean(np.log(p)))


def predict_label(family: str, weights: np.ndarray, x: np.ndarray) -> np.ndarray:
  """[..., N] class decision of weights [..., p, C] on x [..., N, p]: argmax indices for
  multinomial, 0/1 (mean > 0.5) for logistic, the mean otherwise."""
  mu = predict_mean(family, weights, x)
  if family == "multinomial":
    return mu.argmax(axis=-1)
  return (mu[..., 0] > 0.5).astype(np.int64) if family == "logistic" else mu[..., 0]
