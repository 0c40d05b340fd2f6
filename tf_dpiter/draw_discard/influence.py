"""Per-token influence budget: an attacker's N accepted updates stay inside N honest clients' envelope.

Unit: one *identity* (a bearer token; the client address without tokens), compared with N
honest clients under the same served spec. With draw tickets the server knows each step
d_t = u_t - h_t; an honest one is s_t + n_t, |s_tj| <= a = gamma * clip, n_tj iid noise of
scale `scale` (Pihur et al., "Differentially-Private "Draw and Discard" Machine Learning",
Algorithm 1). C_N = sum_t d_t = S_N + W_N, |S_Nj| <= N a; the N-th submit is accepted only if

  * per weight:  max_j |C_Nj| <= N a + x_N scale,
  * aggregate:   sum_j max(|C_Nj| - N a, 0) <= U_N scale          (<= sum_j |W_Nj| / scale),

where x_N and U_N are Chernoff bounds at level alpha_N / 3 each, alpha_N = alpha 6/(pi^2 N^2)
(sum_N alpha_N = alpha: the statement holds at every N simultaneously):

  Laplace, per weight:  P(W_N > x b) <= exp(-l x) (1 - l^2)^(-N)       (union over 2p tails);
  Laplace, aggregate:   E exp(l |W_N|/b) <= 2 (1 - l^2)^(-N) - 1 + l sqrt(2N)
                        (e^{l|w|} = 2 cosh(l w) - e^{-l|w|} <= 2 cosh(l w) - 1 + l|w|, and
                        E|W| <= sqrt(E W^2)), and 1/(1 - l) exactly when N = 1;
  Gaussian:             W_N / sigma ~ N(0, N): sqrt(N) times the one-step bounds.

Bound (false rejection): P(an honest identity is ever refused by the budget) <= alpha,
over its whole life (any data, any order, any asynchrony: only Algorithm 1 is assumed).

Bound (influence): with rebasing (the default) the server stores h'_t + d_t (h'_t drawn
uniformly on arrival) in a random slot r_t, so the average of the k instances moves by
(1/k) [C_N + sum_t (h'_t - x_{r_t})], the second term of mean zero whoever submits:
E[shift] = E[C_N] / k, per weight at most (N a + x_N scale) / k against N a / k for N honest
clients (ratio 1 + x_N scale / (N a), falling like 1/sqrt(N)). Without rebasing an identity
can discard draws until it holds a favourable h, which this budget does not see.

Limits: T identities (tokens; address prefixes, sybil.py) have T budgets; the envelope is per
server process (the rate test is cluster-wide on Redis). Decay, rate cap and the lifetime
test: InfluenceBudget; the bounds in numbers: docs/draw_discard_security.md, section 4.
"""

from __future__ import annotations

import heapq
import math
import time

import numpy as np

from tf_dpiter import validation
from tf_dpiter.draw_discard import acceptance
from tf_dpiter.errors import BudgetConfigError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError

_AT_LEAST_ONE = validation.Interval(float, 1, None, "left", True, ParameterValueError)

_LAM = np.geomspace(1e-7, 0.999, 3000)


def lifetime_alpha(alpha: float, n: int) -> float:
  """alpha_n = alpha 6 / (pi^2 n^2) at step n >= 1: the levels sum to alpha over n = 1, 2, ..."""
  return alpha * 6.0 / (math.pi**2 * n * n)


def _log_two_cosh_mgf(n: int) -> np.ndarray:
  return -n * np.log1p(-_LAM**2)  # ln E exp(l W_n), W_n a sum of n Laplace(1)


def laplace_sum_quantile(p: int, n: int, alpha: float) -> float:
  """x (units of b) with 2p P(W_n > x) <= alpha, W_n a sum of n iid Laplace(1), union over the
  p weights' two tails (Chernoff; exact for n = 1)."""
  x = float(np.min((_log_two_cosh_mgf(n) + math.log(2 * p / alpha)) / _LAM))
  return min(x, math.log(p / alpha)) if n == 1 else x


def laplace_sum_l1_quantile(p: int, n: int, alpha: float) -> float:
  """U (units of b) with P(sum_j |W_nj| >= U) <= alpha over p iid sums of n Laplace(1)
  (Chernoff)."""
  big = _log_two_cosh_mgf(n)
  log_m = big + np.log(2.0 - np.exp(-big) + _LAM * math.sqrt(2.0 * n) * np.exp(-big))
  if n == 1:
    log_m = np.minimum(log_m, -np.log1p(-_LAM))  # exact: E exp(l |L|) = 1/(1 - l)
  return float(np.min((p * log_m + math.log(1.0 / alpha)) / _LAM))


def envelope(noise: str, p: int, n: int, alpha: float) -> tuple[float, float]:
  """(x_n, U_n) of the module docstring for p weights and n >= 1 steps, in units of the noise
  scale, at level alpha each; (0, 0) for noise "none".

  Raises:
    ParameterValueError: n < 1.
    PrivacyConfigError: a noise law other than "laplace", "gaussian" or "none".
  """
  validation.check_params({"n": _AT_LEAST_ONE}, {"n": n})
  if n == int(n):
    n = int(n)
  if noise == "none":
    return 0.0, 0.0
  if noise == "laplace":
    return laplace_sum_quantile(p, n, alpha), laplace_sum_l1_quantile(p, n, alpha)
  if noise == "gaussian":
    r = math.sqrt(n)
    return (r * acceptance.per_weight_quantile("gaussian", p, alpha),
            r * acceptance.upper_quantile("gaussian", p, alpha))
  raise PrivacyConfigError(f"noise must be 'laplace', 'gaussian' or 'none', got {noise!r}")


class InfluenceBudget:
  """Decayed cumulative step per identity, checked against honest clients' envelope and rate.

  State per identity (decay f = 2^(-dt / half_life_s) between two submits; 1 without a
  half-life): N accepted submits, S1 = sum_t f_t, S2 = sum_t f_t^2 and C = sum_t f_t d_t,
  f_t the decay since submit t. A submit is accepted only if, with its step added,

    * rate:        S1 <= max_steps                          (else "influence_rate"),
    * per weight:  max_j |C_j| <= S1 a + x(S2) scale         (else "cumulative_step_too_large"),
    * aggregate:   sum_j max(|C_j| - S1 a, 0) <= U(S2) scale (else "cumulative_excess_too_large"),
    * lifetime, per weight: max_j |L_j| <= N a + x(N) scale, L = sum_t d_t undecayed
                                                  (else "lifetime_step_too_large"),

  x and U: `envelope` with S2 (resp. N) for n, at level alpha_N / 3 each. Since
  -ln(1 - l^2 f^2) <= -f^2 ln(1 - l^2) for 0 <= f <= 1, the decayed noise sum has the moment
  bound of S2 undecayed noises: honest identities pass with probability >= 1 - alpha over
  their life. In any T seconds at most max_steps (1 + T ln 2 / half_life_s) submits pass.

  Args:
    rule: the AcceptanceRule of the served spec (step a, noise law, scale, p).
    alpha: lifetime false-rejection probability of one honest identity, in (0, 0.5).
    max_identities: identities kept.
    max_steps: rate cap on S1 (None: no cap).
    half_life_s: decay half-life in seconds, finite (None: no decay, the undecayed envelope).
    max_memory_bytes: bound on the budget's memory (16 p + 160 bytes per identity).
    clock: time source in seconds (tests, benchmarks).

  Eviction: an identity may be forgotten once S1 < `FORGET_BELOW` = 1; a newcomer is refused
  ("influence_table_full") only when none can be (without decay: least recently used).

  Raises:
    ParameterValueError: for alpha outside (0, 0.5), max_identities < 1, max_steps < 1,
      half_life_s <= 0 or infinite, or max_memory_bytes too small for one identity.
  """

  FORGET_BELOW = 1.0

  def __init__(self, rule: acceptance.AcceptanceRule, alpha: float = 1e-3,
               max_identities: int = 100_000, *, max_steps: float | None = 8.0,
               half_life_s: float | None = 300.0, max_memory_bytes: int = 256 << 20,
               clock=time.monotonic):
    if not 0 < alpha < 0.5:
      raise BudgetConfigError(f"budget alpha must be in (0, 0.5), got {alpha!r}")
    validation.check_integer("max_identities", max_identities, 1)
    validation.check_params({"max_steps": validation.Optional(_AT_LEAST_ONE)}, {"max_steps": max_steps})
    if half_life_s is not None:
      # finite (None: no decay): Redis keeps the rate key for 20 half-lives in milliseconds
      validation.check_positive("half_life_s", half_life_s, False, ParameterValueError)
    per_identity = 16 * rule.p + 160
    if max_memory_bytes < per_identity:
      raise ParameterValueError(f"`max_memory_bytes` must hold one identity ({per_identity} bytes). "
                                f"Received: max_memory_bytes={max_memory_bytes!r}")
    self.p, self.step, self.scale, self.noise = rule.p, rule.step, rule.scale, rule.noise
    self.alpha = float(alpha)
    self.max_identities = min(int(max_identities), int(max_memory_bytes // per_identity))
    self.max_steps = None if max_steps is None else float(max_steps)
    self.half_life_s = None if half_life_s is None else float(half_life_s)
    self.clock = clock
    self._env: dict = {}
    self._state: dict = {}  # id -> [N, S1, S2, C, t, L]
    self._heap: list = []  # (forgettable-from time, id); stale pairs are skipped lazily

  def describe(self) -> dict:
    """The budget's settings, a JSON-serializable dict (part of the store's join check)."""
    return dict(alpha=self.alpha, max_steps=self.max_steps, half_life_s=self.half_life_s)

  def limits(self, n: int, s1: float | None = None, s2: float | None = None) -> tuple:
    """(s1 step + x scale, u scale): the per-weight limit on |C_j| and the aggregate limit on the
    excess at the n-th submit (n >= 1 for the level alpha_n; s1, s2 default n), in weight units.
    Cached at S2 rounded up to a multiple of 1/16 and n up to a power of two: both only raise
    the limits."""
    s1 = float(n) if s1 is None else s1
    s2 = float(n) if s2 is None else s2
    key = (1 << (int(n) - 1).bit_length(), math.ceil(s2 * 16.0 - 1e-9) / 16.0)
    env = self._env.get(key)
    if env is None:
      env = envelope(self.noise, self.p, max(1.0, key[1]), lifetime_alpha(self.alpha, key[0]) / 3)
      if len(self._env) > 100_000:
        self._env.clear()
      self._env[key] = env
    x, u = env
    return s1 * self.step + x * self.scale, u * self.scale

  def _decay(self, t_last: float, now: float) -> float:
    return 1.0 if self.half_life_s is None else 2.0 ** (-max(0.0, now - t_last) / self.half_life_s)

  def state(self, identity: str) -> tuple[int, np.ndarray]:
    """(accepted steps n, a copy of the decayed cumulative step C [p] float64 now) of an
    identity; zeros when unknown."""
    st = self._state.get(identity)
    if st is None:
      return 0, np.zeros(self.p)
    return st[0], st[3] * self._decay(st[4], self.clock())

  def wait_s(self, identity: str) -> float:
    """Seconds until the identity's rate allows one more submit (0: now)."""
    st = self._state.get(identity)
    if st is None or self.max_steps is None or self.half_life_s is None:
      return 0.0
    s1 = st[1] * self._decay(st[4], self.clock())
    if s1 + 1 <= self.max_steps:
      return 0.0
    return self.half_life_s * math.log2(s1 / (self.max_steps - 1.0))

  def forget_time(self, st: list) -> float:
    """When (its clock, seconds) an identity of state st = [N, S1, S2, C, t_last, L] may be
    forgotten: its decayed count S1 falls below FORGET_BELOW."""
    if self.half_life_s is None:
      return st[4]
    if st[1] < self.FORGET_BELOW:
      return -math.inf
    return st[4] + self.half_life_s * math.log2(st[1] / self.FORGET_BELOW)

  def _keep(self, identity: str, st: list) -> None:
    self._state[identity] = st
    heapq.heappush(self._heap, (self.forget_time(st), identity))
    if len(self._heap) > 2 * len(self._state) + 64:  # drop stale pairs: O(n) every n pushes
      self._heap = [(self.forget_time(v), k) for k, v in self._state.items()]
      heapq.heapify(self._heap)

  def room_in_s(self) -> float:
    """Seconds until some identity can be forgotten, the heap's earliest forget time minus now
    (0: now, or the table is not full)."""
    now = self.clock()
    if len(self._state) < self.max_identities or self._make_room(now) or not self._heap:
      return 0.0
    return max(0.0, self._heap[0][0] - now)  # _make_room left the earliest valid entry on top

  def _make_room(self, now: float) -> bool:
    while len(self._state) >= self.max_identities:
      if not self._heap:
        return False
      when, oldest = self._heap[0]
      st = self._state.get(oldest)
      if st is None or self.forget_time(st) != when:
        heapq.heappop(self._heap)  # stale: the identity was forgotten or used since
        continue
      if self.half_life_s is not None and when >= now:
        return False  # the earliest forgettable identity is not forgettable yet: nobody is
      heapq.heappop(self._heap)
      del self._state[oldest]
    return True

  def reserve(self, identity: str, d: np.ndarray) -> str:
    """Adds the step d = u - h [p] to the identity's budget if the result passes the class
    docstring's tests; call `release(identity, d)` when the update is not stored after all.
    Returns "" when reserved, else "influence_rate", "influence_table_full",
    "cumulative_step_too_large", "cumulative_excess_too_large" or "lifetime_step_too_large"."""
    now = self.clock()
    st = self._state.pop(identity, None)
    if st is None:
      if not self._make_room(now):
        return "influence_table_full"
      st = [0, 0.0, 0.0, np.zeros(self.p), now, np.zeros(self.p)]
    f = self._decay(st[4], now)
    n, s1, s2, c = st[0] + 1, st[1] * f + 1.0, st[2] * f * f + 1.0, st[3] * f + d
    life = st[5] + d
    reason = ("influence_rate" if self.max_steps is not None and s1 > self.max_steps + 1e-9
              else self._envelope_reason(n, s1, s2, c, life))
    if not reason:
      st = [n, s1, s2, c, now, life]
    if st[0] > 0:
      self._keep(identity, st)
    return reason

  def _envelope_reason(self, n: int, s1: float, s2: float, c: np.ndarray,
                       life: np.ndarray) -> str:
    """The envelope tests of the class docstring on (N, S1, S2, C, L) ("" when all pass)."""
    lim_w, lim_u = self.limits(n, s1, s2)
    tol = 1e-9 * (lim_w + self.scale) + 1e-12
    mag = np.abs(c)
    if mag.max() > lim_w + tol:
      return "cumulative_step_too_large"
    if np.maximum(mag - s1 * self.step, 0.0).sum() > lim_u + tol * self.p:
      return "cumulative_excess_too_large"
    lim_l = self.limits(n, float(n), float(n))[0]
    if np.abs(life).max() > lim_l + 1e-9 * (lim_l + self.scale) + 1e-12:
      return "lifetime_step_too_large"
    return ""

  def release(self, identity: str, d: np.ndarray) -> None:
    """Undoes the reservation of step d [p] by `identity` (the update was not stored)."""
    st = self._state.get(identity)
    if st is None:
      return
    if st[0] <= 1:
      del self._state[identity]
    else:
      self._keep(identity, [st[0] - 1, st[1] - 1.0, st[2] - 1.0, st[3] - d, st[4], st[5] - d])
