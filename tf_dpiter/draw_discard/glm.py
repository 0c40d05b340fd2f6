"""Generalized linear models and server-side model specs for Draw and Discard.

Section III-A of Pihur et al. (seed 004): E(Y) = g^-1(b_0 + b_1 X_1 + ... + b_p X_p), Eq. (1).
Section V-C: the model spec (which features, which two-way crosses) is sent by the
server, so several models train on the same client-side records.

Weights are stored flat: a GLM with p columns (intercept included) has p weights; a
multinomial logistic regression with C classes has p*C weights laid out as a
row-major [p, C] matrix.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any, Mapping, Sequence

import numpy as np

FAMILIES = ("linear", "logistic", "poisson", "multinomial")
FEATURE_TYPES = ("numeric", "boolean", "categorical", "vector")

# exp() argument cap for the Poisson mean; keeps the gradient finite (it is clipped anyway).
_MAX_ETA = 30.0


def _check_family(family: str) -> str:
  if family not in FAMILIES:
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
  return family


@dataclasses.dataclass(frozen=True)
class Feature:
  """One predictor of a model spec.

  type "numeric": min/max rescale the raw value to [0, 1] (then clipped to [0, 1]).
  type "boolean": 0/1.
  type "categorical": levels; dummy coded with the first level as reference
    (len(levels) - 1 columns), as the E_1, E_2 coding of Section V-C.
  type "vector": a dense block of `size` values (MNIST pixels), rescaled by min/max.
  """
  name: str
  type: str = "numeric"
  min: float = 0.0
  max: float = 1.0
  levels: tuple = ()
  size: int = 1

  def __post_init__(self):
    if self.type not in FEATURE_TYPES:
      raise ValueError(f"feature type must be one of {FEATURE_TYPES}, got {self.type!r} "
                       f"(feature {self.name!r})")
    if self.type in ("numeric", "vector") and not self.max > self.min:
      raise ValueError(f"feature {self.name!r}: max must exceed min, got min={self.min}, max={self.max}")
    if self.type == "categorical" and len(self.levels) < 2:
      raise ValueError(f"feature {self.name!r}: categorical needs >= 2 levels, got {self.levels!r}")
    if self.type == "vector" and self.size < 1:
      raise ValueError(f"feature {self.name!r}: size must be >= 1, got {self.size}")

  @property
  def column_names(self) -> list[str]:
    if self.type == "categorical":
      return [f"{self.name}={lvl}" for lvl in self.levels[1:]]
    if self.type == "vector":
      return [f"{self.name}[{i}]" for i in range(self.size)]
    return [self.name]

  def encode(self, values: Any) -> np.ndarray:
    """Columns in [0, 1] for N raw values: shape [N, len(column_names)]."""
    if self.type == "categorical":
      vals = np.asarray(values).reshape(-1)
      out = np.zeros((vals.shape[0], len(self.levels) - 1))
      known = set(self.levels)
      for v in set(vals.tolist()):
        if v not in known:
          raise ValueError(f"feature {self.name!r}: unknown level {v!r}; levels are {self.levels!r}")
      for j, lvl in enumerate(self.levels[1:]):
        out[:, j] = vals == lvl
      return out
    x = np.asarray(values, dtype=np.float64)
    if self.type == "vector":
      x = x.reshape(x.shape[0], -1)
      if x.shape[1] != self.size:
        raise ValueError(f"feature {self.name!r}: expected {self.size} values per record, got {x.shape[1]}")
    else:
      x = x.reshape(-1, 1)
    if not np.all(np.isfinite(x)):
      raise ValueError(f"feature {self.name!r}: non-finite values")
    if self.type == "boolean":
      return (x != 0).astype(np.float64)
    return np.clip((x - self.min) / (self.max - self.min), 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Server-controlled model specification (Section V-C).

  family: "linear" | "logistic" | "poisson" | "multinomial".
  features: predictors, each encoded to [0, 1] columns.
  crosses: pairs (or tuples) of feature names; every product of their columns is a column.
  num_classes: classes C of the multinomial model (ignored otherwise).
  intercept: prepend a constant-1 column (b_0).
  version: opaque model version string; a submitted instance must carry the same one.
  gamma, epsilon, clip, noise, delta: the client-side training parameters of Algorithm 1
    (epsilon None = no noise), sent to clients together with the instance.
  """
  family: str
  features: tuple
  crosses: tuple = ()
  num_classes: int = 2
  intercept: bool = True
  name: str = "model"
  version: str = "1"
  gamma: float = 0.001
  epsilon: float | None = None
  clip: float = 1.0
  noise: str = "laplace"
  delta: float = 1e-6

  def __post_init__(self):
    _check_family(self.family)
    names = [f.name for f in self.features]
    if len(set(names)) != len(names):
      raise ValueError(f"features: duplicate names in {names!r}")
    for cross in self.crosses:
      if len(cross) < 2:
        raise ValueError(f"crosses: each cross needs >= 2 features, got {cross!r}")
      for n in cross:
        if n not in names:
          raise ValueError(f"crosses: unknown feature {n!r} in {cross!r}")
    if self.family == "multinomial" and self.num_classes < 2:
      raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
    if not self.gamma > 0:
      raise ValueError(f"gamma must be > 0, got {self.gamma}")
    if self.epsilon is not None and not self.epsilon > 0:
      raise ValueError(f"epsilon must be > 0 or None, got {self.epsilon}")
    if not self.clip > 0:
      raise ValueError(f"clip must be > 0, got {self.clip}")
    if self.noise not in ("laplace", "gaussian", "none"):
      raise ValueError(f"noise must be 'laplace', 'gaussian' or 'none', got {self.noise!r}")

  # ---- shapes ----
  @property
  def column_names(self) -> list[str]:
    by_name = {f.name: f for f in self.features}
    cols = ["(intercept)"] if self.intercept else []
    for f in self.features:
      cols += f.column_names
    for cross in self.crosses:
      for combo in itertools.product(*[by_name[n].column_names for n in cross]):
        cols.append("*".join(combo))
    return cols

  @property
  def num_columns(self) -> int:
    return len(self.column_names)

  @property
  def outputs(self) -> int:
    return self.num_classes if self.family == "multinomial" else 1

  @property
  def num_weights(self) -> int:
    return self.num_columns * self.outputs

  # ---- encoding ----
  def featurize(self, records: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Design matrix X [N, num_columns] in [0, 1] from raw records (columns dict or row dicts)."""
    if not isinstance(records, Mapping):
      rows = list(records)
      records = {f.name: [r[f.name] for r in rows] for f in self.features}
    blocks = {f.name: f.encode(records[f.name]) for f in self.features}
    n = next(iter(blocks.values())).shape[0] if blocks else 0
    cols = [np.ones((n, 1))] if self.intercept else []
    cols += [blocks[f.name] for f in self.features]
    for cross in self.crosses:
      for combo in itertools.product(*[range(blocks[c].shape[1]) for c in cross]):
        prod = np.ones(n)
        for c, j in zip(cross, combo):
          prod = prod * blocks[c][:, j]
        cols.append(prod[:, None])
    return np.concatenate(cols, axis=1)

  # ---- serialization ----
  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["features"] = [dict(dataclasses.asdict(f), levels=list(f.levels)) for f in self.features]
    d["crosses"] = [list(c) for c in self.crosses]
    return d

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelSpec":
    d = dict(d)
    feats = tuple(Feature(**dict(f, levels=tuple(f.get("levels", ())))) for f in d.pop("features"))
    crosses = tuple(tuple(c) for c in d.pop("crosses", ()))
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
      raise ValueError(f"model spec: unknown keys {sorted(unknown)!r}")
    return cls(features=feats, crosses=crosses, **d)

  @classmethod
  def from_json(cls, text: str) -> "ModelSpec":
    return cls.from_dict(json.loads(text))

  @classmethod
  def load(cls, path: str) -> "ModelSpec":
    with open(path) as f:
      return cls.from_json(f.read())


# ---------------------------------------------------------------------------
# GLM mean, gradient and loss (vectorized over clients)
# ---------------------------------------------------------------------------

def weights_matrix(weights: np.ndarray, num_columns: int, outputs: int) -> np.ndarray:
  """[..., p*C] flat weights -> [..., p, C] (C = 1 for single-output families)."""
  w = np.asarray(weights)
  return w.reshape(w.shape[:-1] + (num_columns, outputs))


def predict_mean(family: str, weights: np.ndarray, x: np.ndarray) -> np.ndarray:
  """Y-hat = g^-1(X B) (Eq. 1). weights [..., p, C], x [..., N, p] -> [..., N, C]."""
  _check_family(family)
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
  """Y as [..., N, C]: one-hot labels for multinomial, a trailing unit axis otherwise."""
  y = np.asarray(y)
  if family == "multinomial":
    return np.eye(outputs)[y.astype(np.int64)]
  return y[..., None].astype(np.float64)


def average_gradient(family: str, weights: np.ndarray, x: np.ndarray, y: np.ndarray,
                     mask: np.ndarray | None = None) -> np.ndarray:
  """Eq. (3) for a GLM: G = 1/N_c sum_i (Y-hat_i - Y_i) X_i, per client.

  weights [M, p, C], x [M, N, p], y [M, N] (labels for multinomial), mask [M, N] of 0/1
  (clients with fewer than N records). Returns [M, p, C]. The canonical-link gradient of
  the negative log-likelihood has this same form for all four families.
  """
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
  """Average negative log-likelihood (squared error / 2 for linear) of one model [p, C]."""
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
  """Class decision: argmax for multinomial, mean > 0.5 for logistic, the mean otherwise."""
  mu = predict_mean(family, weights, x)
  if family == "multinomial":
    return mu.argmax(axis=-1)
  if family == "logistic":
    return (mu[..., 0] > 0.5).astype(np.int64)
  return mu[..., 0]
