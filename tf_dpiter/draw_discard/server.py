"""Server side of Draw and Discard: Algorithm 2 of Pihur et al. 2018 (Section III-C), in memory.

k model instances; each request draws one uniformly; the returned instance replaces one
uniformly (discard). Initialization N(b^0, k/2 sigma^2) (Theorem 1). The alternatives of
Section V-B, for Figures 2-4: "same_instance" (overwrite the drawn instance),
"average_draw_discard" / "average_same_instance" (overwrite with the mean of it and the
update), "accept_1_over_k" (one model, accept with probability 1/k), "server_batch" (one
model, replaced by the average of batch_size returned models, Section V-A). The spam filter of Section III-D4 (mu +- t sigma per weight, ddof=1) is kept
for the paper's simulations only (submitters can steer it; the HTTP service uses
acceptance.AcceptanceRule). `draw` returns the drawn index; the HTTP service never records it.
"""

from __future__ import annotations

import collections

import numpy as np

from tf_dpiter import validation
from tf_dpiter.draw_discard import glm
from tf_dpiter.errors import ParameterValueError

STRATEGIES = ("draw_discard", "same_instance", "average_draw_discard", "average_same_instance",
              "accept_1_over_k", "server_batch")


def initial_instances(k: int, num_weights: int, init_mean=0.0, init_std: float = 0.0,
                      rng: np.random.Generator | None = None) -> np.ndarray:
  """k instances ~ N(b^0, init_std^2) per weight; init_std^2 = k/2 sigma^2 (Theorem 1).

  Args:
    k: number of instances (integer >= 1).
    num_weights: p (integer >= 1).
    init_mean: b^0, a scalar or [p].
    init_std: per-weight std (>= 0).
    rng: generator (default: fresh OS entropy).

  Returns:
    [k, p] float64.

  Raises:
    ParameterValueError: for a bad k, num_weights or init_std.
  """
  validation.check_integer("k", k, 1)
  validation.check_integer("num_weights", num_weights, 1)
  validation.check_nonnegative("init_std", init_std, error=ParameterValueError)
  rng = rng if rng is not None else np.random.default_rng()
  mean = np.broadcast_to(np.asarray(init_mean, dtype=np.float64), (num_weights,))
  return mean + init_std * rng.standard_normal((int(k), int(num_weights)))


class SpamFilter:
  """Refuse an instance with any weight outside mu +- t sigma of the k instances (III-D4).

  Args:
    t: the accepted band's half-width in standard deviations (> 0; inf: accept all).
    min_std: the floor of sigma (>= 0; coinciding instances would refuse every update).

  Raises:
    ParameterValueError: t <= 0 or min_std < 0.
  """

  def __init__(self, t: float, min_std: float = 0.0):
    validation.check_positive("t", t, allow_inf=True, error=ParameterValueError)
    validation.check_nonnegative("min_std", min_std, error=ParameterValueError)
    self.t = float(t)
    self.min_std = float(min_std)
    self.mu = self.sigma = None

  def fit(self, instances: np.ndarray) -> None:
    """Sets mu and sigma (ddof=1, floored at min_std) from the current instances.

    Args:
      instances: [k, p] the server's instances.

    Raises:
      ParameterValueError: for fewer than 2 instances.
    """
    if instances.shape[0] < 2:
      raise ParameterValueError(f"spam filter needs k >= 2 instances, got k={instances.shape[0]}")
    self.mu = instances.mean(axis=0)
    self.sigma = np.maximum(instances.std(axis=0, ddof=1), self.min_std)

  def accepts(self, updates: np.ndarray) -> np.ndarray:
    """Boolean [n] for updates [n, p] (or a scalar bool for [p]).

    Args:
      updates: [n, p] or [p] submitted instances (after fit).

    Returns:
      [n] bool, or a bool.
    """
    dev = np.abs(np.asarray(updates) - self.mu)
    return np.all(dev <= self.t * self.sigma, axis=-1)


class DrawDiscardServer:
  """k instances with draw / discard (Algorithm 2) and the Section V-B alternatives.

  Args:
    k: the number of instances (an integer >= 1).
    num_weights: p, the weights of one instance.
    strategy: one of STRATEGIES ("draw_discard": Algorithm 2; the others: Section V-B).
    init_mean: b^0, the initial weights' mean, a scalar or [p].
    init_std: the initial weights' per-weight std (>= 0; Theorem 1: k/2 sigma^2 as variance).
    batch_size: updates averaged per write ("server_batch" only).
    spam_t: the spam filter's band in standard deviations (None: no filter; `SpamFilter`).
    spam_min_std: the spam filter's floor of sigma.
    rng: numpy Generator of the draws (default: fresh OS entropy).
    instances: [k, p] initial instances instead of drawing them.

  Raises:
    ParameterValueError: an unknown strategy, k or batch_size not an integer >= 1, or
      instances of the wrong shape.
  """

  def __init__(self, k: int, num_weights: int, *, strategy: str = "draw_discard",
               init_mean=0.0, init_std: float = 0.0, batch_size: int = 1,
               spam_t: float | None = None, spam_min_std: float = 0.0,
               rng: np.random.Generator | None = None, instances: np.ndarray | None = None):
    validation.check_one_of("strategy", strategy, STRATEGIES)
    validation.check_integer("k", k, 1)
    validation.check_integer("batch_size", batch_size, 1)
    self.k = int(k)
    self.strategy = strategy
    self.batch_size = int(batch_size) if strategy == "server_batch" else 1
    self.rng = rng if rng is not None else np.random.default_rng()
    n_inst = 1 if strategy in ("accept_1_over_k", "server_batch") else self.k
    if instances is None:
      instances = initial_instances(n_inst, num_weights, init_mean, init_std, self.rng)
    instances = np.array(instances, dtype=np.float64)
    if instances.shape != (n_inst, num_weights):
      raise ParameterValueError(f"instances must have shape {(n_inst, num_weights)}, got {instances.shape}")
    self.instances = instances
    self.spam = SpamFilter(spam_t, spam_min_std) if spam_t is not None else None
    self._buffer: list[np.ndarray] = []
    self.counters = collections.Counter()

  @property
  def num_weights(self) -> int:
    """p, the length of an instance."""
    return self.instances.shape[1]

  # ---- Algorithm 2 ----
  def draw(self, n: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Draw n instances uniformly (with replacement): (indices [n], weights [n, p]).

    Args:
      n: number of draws.

    Returns:
      (indices [n], weights [n, p]; rows of the live array: copy before changing them).
    """
    idx = self.rng.integers(0, self.instances.shape[0], size=n)
    self.counters["draws"] += n
    return idx, self.instances[idx]

  def submit(self, updates: np.ndarray, drawn: np.ndarray | None = None) -> np.ndarray:
    """Put back n updated instances in order; returns accepted [n] (bool).

    Updates refused by the spam filter or dropped by "accept_1_over_k" are not stored.

    Args:
      updates: [n, p] or [p] updated instances.
      drawn: [n] the drawn indices (needed by "same_instance" strategies), or None.

    Returns:
      [n] bool: which updates were stored.

    Raises:
      ParameterValueError: for a wrong number of weights, or missing drawn indices.
    """
    updates = np.atleast_2d(np.asarray(updates, dtype=np.float64))   # [p]: one update
    n = updates.shape[0]
    if updates.shape[1] != self.num_weights:
      raise ParameterValueError(f"updates must have {self.num_weights} weights, got {updates.shape[1]}")
    self.counters["submits"] += n
    ok = np.ones(n, dtype=bool)
    if self.spam is not None:
      self.spam.fit(self.instances)
      ok = self.spam.accepts(updates)
      self.counters["rejected_spam"] += int((~ok).sum())
    s = self.strategy
    if s == "accept_1_over_k":
      keep = ok & (self.rng.random(n) < 1.0 / self.k)
      self.counters["dropped"] += int((ok & ~keep).sum())
      if keep.any():
        self.instances[0] = updates[np.flatnonzero(keep)[-1]]
      self.counters["accepted"] += int(keep.sum())
      return keep
    if s == "server_batch":
      for i in np.flatnonzero(ok):
        self._buffer.append(updates[i])
        if len(self._buffer) >= self.batch_size:
          self.instances[0] = np.mean(self._buffer, axis=0)
          self._buffer = []
          self.counters["batches"] += 1
      self.counters["accepted"] += int(ok.sum())
      return ok
    if s in ("same_instance", "average_same_instance"):
      if drawn is None:
        raise ParameterValueError(f"strategy {s!r} needs the drawn indices")
      slots = np.asarray(drawn).reshape(-1)
    else:
      slots = self.rng.integers(0, self.k, size=n)
    average = s.startswith("average")
    for i in np.flatnonzero(ok):
      j = slots[i]
      self.instances[j] = 0.5 * (self.instances[j] + updates[i]) if average else updates[i]
    self.counters["accepted"] += int(ok.sum())
    return ok

  # ---- prediction ----
  def average_weights(self) -> np.ndarray:
    """Mean of the k instances (Algorithm 2's prediction model).

    Returns:
      [p] float64.
    """
    return self.instances.mean(axis=0)

  def predict_mean(self, family: str, x: np.ndarray, outputs: int = 1,
                   mode: str = "weights") -> np.ndarray:
    """E(Y|x) by averaging weights (mode 'weights') or averaging predictions ('predictions').

    Args:
      family: the GLM family.
      x: [N, p] features.
      outputs: C.
      mode: "weights" or "predictions".

    Returns:
      [N, C] float64.

    Raises:
      ParameterValueError: for an unknown mode.
    """
    p = x.shape[-1]
    if mode == "weights":
      return glm.predict_mean(family, glm.weights_matrix(self.average_weights(), p, outputs), x)
    if mode == "predictions":
      w = glm.weights_matrix(self.instances, p, outputs)
      return np.mean([glm.predict_mean(family, wi, x) for wi in w], axis=0)
    raise ParameterValueError(f"mode must be 'weights' or 'predictions', got {mode!r}")

  def metrics(self) -> dict:
    """Counters of draws, submits, accepted, spam-rejected (and dropped, batches), k and strategy.

    Returns:
      A dict.
    """
    return dict(dict.fromkeys(("draws", "submits", "accepted", "rejected_spam"), 0),
                **self.counters, k=self.k, strategy=self.strategy)
