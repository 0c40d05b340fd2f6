"""Generalized linear models and server-side model specs for Draw and Discard.

Pihur et al. 2018, Section III-A: E(Y) = g^-1(b_0 + b_1 X_1 + ... + b_p X_p), Eq. (1);
Section V-C: the server sends the model spec (features, two-way crosses). Weights are flat:
p (intercept included), or p*C for a C-class multinomial, row-major [p, C]. The mean,
gradient and loss live in glm_math.py (re-exported).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any, Mapping, Sequence

import numpy as np

from tf_dpiter import validation
from tf_dpiter.draw_discard.glm_math import (  # re-exported
    FAMILIES, average_gradient, check_family, mean_loss, predict_label, predict_mean,
    response_matrix, weights_matrix)

from tf_dpiter.errors import ParameterValueError

from tf_dpiter.errors import PrivacyConfigError
__all__ = ["FAMILIES", "FEATURE_TYPES", "Feature", "ModelSpec", "average_gradient",
           "check_family", "mean_loss", "predict_label", "predict_mean", "response_matrix",
           "weights_matrix"]

FEATURE_TYPES = ("numeric", "boolean", "categorical", "vector")


@dataclasses.dataclass(frozen=True)
class Feature:
  """One predictor of a model spec.

  type "numeric": min/max rescale the raw value to [0, 1] (then clipped to [0, 1]).
  type "boolean": 0/1.
  type "categorical": levels; dummy coded with the first level as reference
    (len(levels) - 1 columns), as the E_1, E_2 coding of Section V-C.
  type "vector": a dense block of `size` values (MNIST pixels), rescaled by min/max.

  Attributes:
    name: the predictor's name.
    type: "numeric", "boolean", "categorical" or "vector".
    min: numeric / vector: the raw value mapped to 0.
    max: numeric / vector: the raw value mapped to 1.
    levels: categorical: the levels (the first is the reference).
    size: vector: the number of values.
  """
  name: str
  type: str = "numeric"
  min: float = 0.0
  max: float = 1.0
  levels: tuple = ()
  size: int = 1

  def __post_init__(self):
    if self.type not in FEATURE_TYPES:
      raise ParameterValueError(f"feature type must be one of {FEATURE_TYPES}, got {self.type!r} "
                                f"(feature {self.name!r})")
    if self.type in ("numeric", "vector") and not self.max > self.min:
      raise ParameterValueError(f"feature {self.name!r}: max must exceed min, got min={self.min}, max={self.max}")
    if self.type == "categorical" and len(self.levels) < 2:
      raise ParameterValueError(f"feature {self.name!r}: categorical needs >= 2 levels, got {self.levels!r}")
    if self.type == "vector" and self.size < 1:
      raise ParameterValueError(f"feature {self.name!r}: size must be >= 1, got {self.size}")

  @property
  def column_names(self) -> list[str]:
    """Names of the design-matrix columns of this feature (categorical: name=level)."""
    if self.type == "categorical":
      return [f"{self.name}={lvl}" for lvl in self.levels[1:]]
    return [f"{self.name}[{i}]" for i in range(self.size)] if self.type == "vector" else [self.name]

  def encode(self, values: Any) -> np.ndarray:
    """Columns in [0, 1] for N raw values (the coding of the class docstring).

    Args:
      values: N raw values ([N, size] for a vector feature).

    Returns:
      [N, len(column_names)] float64.

    Raises:
      ParameterValueError: for an unknown level, a wrong vector size or a non-finite value.
    """
    if self.type == "categorical":
      vals = np.asarray(values).reshape(-1)
      out = np.zeros((vals.shape[0], len(self.levels) - 1))
      known = set(self.levels)
      for v in set(vals.tolist()):
        if v not in known:
          raise ParameterValueError(f"feature {self.name!r}: unknown level {v!r}; levels are {self.levels!r}")
      for j, lvl in enumerate(self.levels[1:]):
        out[:, j] = vals == lvl
      return out
    x = np.asarray(values, dtype=np.float64)
    if self.type == "vector":
      x = x.reshape(x.shape[0], -1)
      if x.shape[1] != self.size:
        raise ParameterValueError(f"feature {self.name!r}: expected {self.size} values per record, got {x.shape[1]}")
    else:
      x = x.reshape(-1, 1)
    if not np.all(np.isfinite(x)):
      raise ParameterValueError(f"feature {self.name!r}: non-finite values")
    if self.type == "boolean":
      return (x != 0).astype(np.float64)
    return np.clip((x - self.min) / (self.max - self.min), 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Server-controlled model specification (Section V-C).

  gamma, epsilon, clip, noise and delta are the client-side training parameters of
  Algorithm 1, sent to clients together with the instance.

  Attributes:
    family: "linear" | "logistic" | "poisson" | "multinomial".
    features: the predictors, each encoded to [0, 1] columns.
    crosses: pairs (or tuples) of feature names; every product of their columns is a column.
    num_classes: classes C of the multinomial model (ignored otherwise).
    intercept: prepend a constant-1 column (b_0).
    name: the model's name.
    version: opaque model version string; a submitted instance must carry the same one.
    gamma: the clients' learning rate (Algorithm 1).
    epsilon: the clients' local epsilon (None: no noise).
    clip: the clients' gradient clip (Algorithm 1).
    noise: the clients' noise law ("laplace", "gaussian" or "none").
    delta: the clients' delta (Gaussian noise).
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
    check_family(self.family)
    names = [f.name for f in self.features]
    if len(set(names)) != len(names):
      raise ParameterValueError(f"features: duplicate names in {names!r}")
    for cross in self.crosses:
      if len(cross) < 2:
        raise ParameterValueError(f"crosses: each cross needs >= 2 features, got {cross!r}")
      for n in cross:
        if n not in names:
          raise ParameterValueError(f"crosses: unknown feature {n!r} in {cross!r}")
    if self.family == "multinomial" and self.num_classes < 2:
      raise ParameterValueError(f"num_classes must be >= 2, got {self.num_classes}")
    validation.check_positive("gamma", self.gamma, allow_inf=True, error=ParameterValueError)
    if self.epsilon is not None:
      validation.check_positive("epsilon", self.epsilon, allow_inf=True)
    validation.check_positive("clip", self.clip, allow_inf=True)
    if self.noise not in ("laplace", "gaussian", "none"):
      raise PrivacyConfigError(f"noise must be 'laplace', 'gaussian' or 'none', got {self.noise!r}")

  # ---- shapes ----
  @property
  def column_names(self) -> list[str]:
    """The num_columns design-matrix column names: intercept, features, then crosses."""
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
    """p, the number of design-matrix columns."""
    return len(self.column_names)

  @property
  def outputs(self) -> int:
    """C: num_classes for multinomial, else 1."""
    return self.num_classes if self.family == "multinomial" else 1

  @property
  def num_weights(self) -> int:
    """p * C, the length of a flat instance."""
    return self.num_columns * self.outputs

  # ---- encoding ----
  def featurize(self, records: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Design matrix X [N, num_columns] in [0, 1] from raw records (columns dict or row dicts).

    Args:
      records: a mapping of feature name -> N values, or a sequence of N row mappings.

    Returns:
      [N, num_columns] float64.
    """
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
    """The spec as a JSON-ready dict (features as dicts, tuples as lists).

    Returns:
      A dict; ModelSpec.from_dict inverts it.
    """
    d = dataclasses.asdict(self)
    d["features"] = [dict(dataclasses.asdict(f), levels=list(f.levels)) for f in self.features]
    d["crosses"] = [list(c) for c in self.crosses]
    return d

  def to_json(self) -> str:
    """The spec as canonical JSON (sorted keys).

    Returns:
      A JSON string.
    """
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelSpec":
    """Builds a spec from to_dict's form (validated by the constructor).

    Args:
      d: the dict.

    Returns:
      A ModelSpec.

    Raises:
      ParameterValueError: for unknown keys or an invalid field.
    """
    d = dict(d)
    feats = tuple(Feature(**dict(f, levels=tuple(f.get("levels", ())))) for f in d.pop("features"))
    crosses = tuple(tuple(c) for c in d.pop("crosses", ()))
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
      raise ParameterValueError(f"model spec: unknown keys {sorted(unknown)!r}")
    return cls(features=feats, crosses=crosses, **d)

  @classmethod
  def from_json(cls, text: str) -> "ModelSpec":
    """Builds a spec from to_json's form.

    Args:
      text: the JSON text.

    Returns:
      A ModelSpec.

    Raises:
      ParameterValueError: for invalid JSON, unknown keys or an invalid field.
    """
    return cls.from_dict(json.loads(text))

  @classmethod
  def load(cls, path: str) -> "ModelSpec":
    """Reads a spec from a JSON file.

    Args:
      path: the file.

    Returns:
      A ModelSpec.

    Raises:
      OSError: when the file cannot be read.
      ParameterValueError: for an invalid spec.
    """
    with open(path) as f:
      return cls.from_json(f.read())
