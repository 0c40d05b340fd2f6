"""Per-token influence budget: an attacker's N accepted updates stay inside N honest clients' envelope.

Relation and unit: the unit is one *identity* (a bearer token; the client address without
tokens); the comparison is between N accepted submits of one identity and N honest
clients' submits under the same served spec.

With draw tickets (tickets.py) the server knows the instance h_t each submit started from,
so it knows the submitted step d_t = u_t - h_t exactly. An honest step is (Algorithm 1)

    d_t = s_t + n_t,   |s_tj| <= a = gamma * clip,   n_tj iid noise of scale `scale`

(Laplace(b): scale = b; Gaussian: scale = sigma), whatever the client's data. For N honest
steps, C_N = sum_t d_t = S_N + W_N with |S_Nj| <= N a and W_Nj a sum of N iid noises. The
budget keeps C_N per identity and accepts the N-th submit only if

  * per weight:  max_j |C_Nj| <= N a + x_N scale,
  * aggregate:   sum_j max(|C_Nj| - N a, 0) <= U_N scale          (<= sum_j |W_Nj| / scale),

where x_N and U_N are Chernoff bounds at level alpha_N / 2 each, alpha_N = alpha 6/(pi^2 N^2)
(so sum_N alpha_N = alpha: the statement holds at every N simultaneously):

  Laplace, per weight:  P(W_N > x b) <= exp(-l x) (1 - l^2)^(-N)       (union over 2p tails);
  Laplace, aggregate:   E exp(l |W_N|/b) <= 2 (1 - l^2)^(-N) - 1 + l sqrt(2N)
                        (e^{l|w|} = 2 cosh(l w) - e^{-l|w|} <= 2 cosh(l w) - 1 + l|w|, and
                        E|W| <= sqrt(E W^2)), and 1/(1 - l) exactly when N = 1;
  Gaussian:             W_N / sigma ~ N(0, N): sqrt(N) times the one-step bounds.

Bound (false rejection): P(an honest identity is ever refused by the budget) <= alpha,
over its whole life (any data, any order, any asynchrony: only Algorithm 1 is assumed).

Bound (influence): every accepted identity satisfies the two inequalities above, which N
honest clients' steps satisfy with probability >= 1 - alpha_N. With rebasing (the
service's default, service.DDMLService(rebase=True)) the server stores h'_t + d_t, h'_t an
instance it draws uniformly when the update arrives, in a uniformly random slot r_t, so the
average of the k instances moves by

    (1/k) sum_t (h'_t + d_t - x_{r_t}) = (1/k) [C_N + sum_t (h'_t - x_{r_t})],

and given the store's state each h'_t - x_{r_t} has mean zero whoever submits. Hence
E[shift of the average] = E[C_N] / k: per weight at most (N a + x_N scale) / k, and summed
over weights at most (p N a + U_N scale) / k, against N a / k (per weight) for N honest
clients whose clipped gradients all point the same way. The ratio tends to 1 as N grows
(x_N, U_N / p ~ sqrt(N)); benchmarks/draw_discard_acceptance.py measures it. The
remaining term has the law it has for honest clients. Without rebasing (Algorithm 2
literally: u itself is stored) an identity can discard draws until it holds a favourable
h (the draw quota bounds how often), which this budget does not see.

Assumptions and limits: Algorithm 1 with the served spec (|s_tj| <= a, the served noise
law) for honest clients; the server's draws use secrets.randbelow. One identity per
attacker: with T tokens each has its own envelope (the step term stays N a, the noise
allowance grows as sqrt(N T) instead of sqrt(N)). The budget is kept per server process:
with P processes behind one store an identity has P envelopes (noise allowance sqrt(P)
times larger; the N a term is unchanged since each process counts its own N_i).
Identities beyond `max_identities` are forgotten least-recently-used first, and a
forgotten identity starts a new budget. Memory: 8 p bytes per identity.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from tf_dpiter.draw_discard import acceptance

_LAM = np.geomspace(1e-7, 0.999, 3000)


def lifetime_alpha(alpha: float, n: int) -> float:
  """alpha_n = alpha 6 / (pi^2 n^2): sums to alpha over n = 1, 2, ...

  Args:
    alpha: the lifetime false-rejection probability.
    n: the step count (>= 1).

  Returns:
    alpha_n.
  """
  return alpha * 6.0 / (math.pi**2 * n * n)


def _log_two_cosh_mgf(n: int) -> np.ndarray:
  return -n * np.log1p(-_LAM**2)  # ln E exp(l W_n), W_n a sum of n Laplace(1)


def laplace_sum_quantile(p: int, n: int, alpha: float) -> float:
  """x with 2p P(W_n > x) <= alpha, W_n a sum of n iid Laplace(1) (Chernoff; exact for n=1).

  Args:
    p: number of weights (union bound over p two-sided tails).
    n: number of summed steps.
    alpha: total tail probability.

  Returns:
    x (in units of the Laplace scale b).
  """
  x = float(np.min((_log_two_cosh_mgf(n) + math.log(2 * p / alpha)) / _LAM))
  return min(x, math.log(p / alpha)) if n == 1 else x


def laplace_sum_l1_quantile(p: int, n: int, alpha: float) -> float:
  """U with P(sum_j |W_nj| >= U) <= alpha over p iid sums of n Laplace(1) (Chernoff).

  Args:
    p: number of weights.
    n: number of summed steps.
    alpha: tail probability.

  Returns:
    U (in units of b).
  """
  big = _log_two_cosh_mgf(n)
  log_m = big + np.log(2.0 - np.exp(-big) + _LAM * math.sqrt(2.0 * n) * np.exp(-big))
  if n == 1:
    log_m = np.minimum(log_m, -np.log1p(-_LAM))  # exact: E exp(l |L|) = 1/(1 - l)
  return float(np.min((p * log_m + math.log(1.0 / alpha)) / _LAM))


def envelope(noise: str, p: int, n: int, alpha: float) -> tuple[float, float]:
  """(x_n, U_n) of the module docstring, in units of the noise scale, at level alpha each.

  Args:
    noise: "laplace", "gaussian" or "none".
    p: number of weights.
    n: number of steps (>= 1).
    alpha: tail probability of each of the two statistics.

  Returns:
    (per-weight allowance, aggregate allowance); (0, 0) without noise.

  Raises:
    ValueError: for an unknown noise law or n < 1.
  """
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n!r}")
  if noise == "none":
    return 0.0, 0.0
  if noise == "laplace":
    return laplace_sum_quantile(p, n, alpha), laplace_sum_l1_quantile(p, n, alpha)
  if noise == "gaussian":
    r = math.sqrt(n)
    return (r * acceptance.per_weight_quantile("gaussian", p, alpha),
            r * acceptance.upper_quantile("gaussian", p, alpha))
  raise ValueError(f"noise must be 'laplace', 'gaussian' or 'none', got {noise!r}")


class InfluenceBudget:
  """Cumulative step per identity, checked against N honest clients' envelope.

  Args:
    rule: the AcceptanceRule of the served spec (step a, noise law, scale, p).
    alpha: lifetime false-rejection probability of one honest identity, in (0, 0.5).
    max_identities: identities kept (least recently used forgotten first).

  Raises:
    ValueError: for alpha outside (0, 0.5) or max_identities < 1.
  """

  def __init__(self, rule: acceptance.AcceptanceRule, alpha: float = 1e-3,
               max_identities: int = 100_000):
    if not 0 < alpha < 0.5:
      raise ValueError(f"budget alpha must be in (0, 0.5), got {alpha!r}")
    if int(max_identities) != max_identities or max_identities < 1:
      raise ValueError(f"max_identities must be an integer >= 1, got {max_identities!r}")
    self.p, self.step, self.scale, self.noise = rule.p, rule.step, rule.scale, rule.noise
    self.alpha, self.max_identities = float(alpha), int(max_identities)
    self._state: collections.OrderedDict = collections.OrderedDict()
    self._env: dict[int, tuple[float, float]] = {}

  def describe(self) -> dict:
    """The budget's settings (part of the store's join check).

    Returns:
      A JSON-serializable dict.
    """
    return dict(alpha=self.alpha)

  def limits(self, n: int) -> tuple[float, float]:
    """(per-weight limit on |C_nj|, aggregate limit on the excess) after n accepted steps.

    Args:
      n: accepted steps (>= 1).

    Returns:
      (n * step + x * scale, u * scale), in weight units.
    """
    env = self._env.get(n)
    if env is None:
      env = envelope(self.noise, self.p, n, lifetime_alpha(self.alpha, n) / 2)
      self._env[n] = env
    x, u = env
    return n * self.step + x * self.scale, u * self.scale

  def state(self, identity: str) -> tuple[int, np.ndarray]:
    """(accepted steps, cumulative step C) of an identity (a copy; zeros when unknown).

    Args:
      identity: the token digest prefix or the client address.

    Returns:
      (n, C [p] float64).
    """
    n, c = self._state.get(identity, (0, None))
    return n, (np.zeros(self.p) if c is None else c.copy())

  def reserve(self, identity: str, d: np.ndarray) -> str:
    """Adds step d to the identity's budget if the result stays inside the envelope.

    Call `release(identity, d)` when the update is not stored after all.

    Args:
      identity: who submits.
      d: [p] the step u - h against the served instance.

    Returns:
      "" when reserved, else "cumulative_step_too_large" or "cumulative_excess_too_large".
    """
    n, c = self._state.pop(identity, (0, None))
    new = d.astype(np.float64) if c is None else c + d
    lim_w, lim_u = self.limits(n + 1)
    tol = 1e-9 * (lim_w + self.scale) + 1e-12
    mag = np.abs(new)
    reason = ""
    if mag.max() > lim_w + tol:
      reason = "cumulative_step_too_large"
    elif np.maximum(mag - (n + 1) * self.step, 0.0).sum() > lim_u + tol * self.p:
      reason = "cumulative_excess_too_large"
    self._state[identity] = (n, c) if reason else (n + 1, new)
    if reason and c is None:
      del self._state[identity]
    while len(self._state) > self.max_identities:
      self._state.popitem(last=False)
    return reason

  def release(self, identity: str, d: np.ndarray) -> None:
    """Undoes a reservation (the update was not stored).

    Args:
      identity: who submitted.
      d: [p] the step that was reserved.
    """
    if identity not in self._state:
      return
    n, c = self._state[identity]
    if n <= 1:
      del self._state[identity]
    else:
      self._state[identity] = (n - 1, c - d)
