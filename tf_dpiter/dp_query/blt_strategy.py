"""Buffered linear Toeplitz (BLT) strategies (numpy + scipy; Dvijotham et al., "Efficient and
near-optimal noise generation for streaming differential privacy", Section 3).

C is lower-triangular Toeplitz, c_0 = 1, c_k = sum_i omega_i theta_i^(k-1): c(z) = P(z) / Q(z),
Q(z) = prod_i (1 - theta_i z); C^-1's coefficients are the impulse response of Q / P.
Sensitivity under b-min-separation, k participations: for non-negative non-increasing
coefficients the worst case is k participations b apart from step 0 (McKenna et al.,
"Scaling up the banded matrix factorization mechanism", Theorem 2); other coefficients are
replaced by their non-increasing envelope of absolute values (an upper bound).
"""

import functools
import math

import numpy as np
from scipy import optimize as sp_optimize
from scipy import signal as sp_signal

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError


def _polys(theta, omega):
  """(P, Q) polynomial coefficients (ascending powers of z) of c(z) = P / Q."""
  q = np.array([1.0])
  for t in theta:
    q = np.convolve(q, [1.0, -t])
  p = np.concatenate([q, [0.0]])
  for i, w in enumerate(omega):
    others = np.array([1.0])
    for j, t in enumerate(theta):
      if j != i:
        others = np.convolve(others, [1.0, -t])
    p[1:1 + len(others)] += w * others
  return p, q


def strategy_coefficients(theta, omega, n):
  """c_0..c_{n-1} (float64 [n]) of the BLT strategy of parameters theta, omega (equal
  lengths)."""
  p, q = _polys(theta, omega)
  return sp_signal.lfilter(p, q, np.eye(1, n)[0])   # of the unit impulse


def inverse_coefficients(theta, omega, n):
  """The first n coefficients (float64 [n]) of C^-1 (also Toeplitz): the impulse response of
  Q / P (`strategy_coefficients`' parameters)."""
  p, q = _polys(theta, omega)
  return sp_signal.lfilter(q, p, np.eye(1, n)[0])   # of the unit impulse


def toeplitz_minsep_sensitivity(coefs, min_separation, max_participations=None):
  """Sensitivity (per unit clip) of a Toeplitz strategy with coefficients `coefs` (n of them)
  when participations are >= min_separation b apart, at most max_participations k times
  (None: ceil(n / b)). Coefficients other than non-negative non-increasing: their envelope is
  used. Returns a float.

  Raises:
    ParameterValueError: min_separation < 1.
  """
  c = np.abs(np.asarray(coefs, np.float64))
  c = np.maximum.accumulate(c[::-1])[::-1]            # non-increasing envelope (upper bound)
  n, b = len(c), int(min_separation)
  if b < 1:
    raise ParameterValueError(f"min_separation must be >= 1, got {min_separation!r}")
  k = -(-n // b) if max_participations is None else min(int(max_participations), -(-n // b))
  column = np.zeros(n)
  for j in range(k):
    column[j * b:] += c[:n - j * b]
  return float(np.linalg.norm(column))


def equivalent_sensitivity(coefs, min_separation, max_participations=None):
  """max over p <= k of toeplitz_minsep_sensitivity(p) / sqrt(p) (p Gaussians of it cost at
  least the run's one Gaussian): Delta per unit clip (a float); arguments as
  `toeplitz_minsep_sensitivity`'s."""
  n, b = len(coefs), int(min_separation)
  k = -(-n // b) if max_participations is None else min(int(max_participations), -(-n // b))
  return max(toeplitz_minsep_sensitivity(coefs, b, p) / math.sqrt(p) for p in range(1, k + 1))


def inverse_prefix_error(coefs_inverse):
  """||A C^-1||_F^2 / n (a float, per unit sigma^2) for a Toeplitz C^-1 given by its first
  column [n]."""
  e = np.cumsum(coefs_inverse)
  n = len(e)
  return float(np.sum((n - np.arange(n)) * e * e) / n)


def _loss(x, n, buffers, b, k):
  x = np.clip(x, -30.0, 30.0)
  theta = 1.0 / (1.0 + np.exp(-x[:buffers]))
  omega = np.exp(x[buffers:])
  with np.errstate(over="ignore", invalid="ignore"):
    c = strategy_coefficients(theta, omega, n)
    d = inverse_coefficients(theta, omega, n)
    if not (np.all(np.isfinite(c)) and np.all(np.isfinite(d))):
      return 1e30
    loss = toeplitz_minsep_sensitivity(c, b, k) ** 2 * inverse_prefix_error(d) * n
  return loss if np.isfinite(loss) else 1e30


# L-BFGS-B starts (decay range of 1 - theta as log10 exponents, omega scale): the loss has
# poor local minima (n = 500, b = 100, k = 5: sqrt(loss) 397 from the first start, 160 from
# the second); the best of these deterministic starts is kept.
_STARTS = ((-0.3, -3.0, 0.2), (-0.1, -2.0, 0.5), (-0.5, -4.0, 0.1), (-1.0, -3.0, 1.0))


@functools.lru_cache(maxsize=32)
def _optimize_cached(n, buffers, b, k, max_iter):
  best = None
  for lo, hi, scale in _STARTS:
    theta0 = 1.0 - np.logspace(lo, hi, buffers)
    omega0 = scale * (1.0 - theta0)
    x0 = np.concatenate([np.log(theta0 / (1 - theta0)), np.log(omega0)])
    res = sp_optimize.minimize(_loss, x0, args=(n, buffers, b, k), method="L-BFGS-B",
                               options={"maxiter": max_iter})
    if best is None or (np.isfinite(res.fun) and res.fun < best.fun):
      best = res
  x = np.clip(best.x, -30.0, 30.0)
  return tuple(1.0 / (1.0 + np.exp(-x[:buffers]))), tuple(np.exp(x[buffers:]))


def optimize_blt(n, buffers, min_separation=1, max_participations=1, max_iter=200):
  """(theta, omega) of a BLT of `buffers` terms minimizing sens^2 ||A C^-1||_F^2 over n steps
  (theta in (0, 1), omega > 0: non-negative coefficients, exact sensitivity), for
  participations `min_separation` b apart, at most `max_participations` k, after `max_iter`
  L-BFGS iterations. Returns (theta, omega), float64 arrays [buffers].

  Raises:
    ParameterTypeError: n, buffers, min_separation or max_participations not an integer.
    ParameterValueError: one of them < 1.
  """
  for name, v in (("n", n), ("buffers", buffers), ("min_separation", min_separation),
                  ("max_participations", max_participations)):
    validation.check_integer(name, v, 1)
  theta, omega = _optimize_cached(int(n), int(buffers), int(min_separation),
                                  int(max_participations), int(max_iter))
  return np.array(theta), np.array(omega)
