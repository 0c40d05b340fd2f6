"""Strategy matrices for correlated-noise mechanisms (pure numpy + scipy, no TensorFlow).

The matrix mechanism releases prefix sums A G of per-step clipped sums G as
A (G + C^-1 Z sigma), Z iid N(0, 1) (Choquette-Choo et al., "(Amplified) Banded Matrix
Factorization: A unified approach to private training", Sections 2-4): privacy is that of
C G + sigma Z, error E ||A C^-1 Z sigma||_F^2 = sigma^2 ||A C^-1||_F^2 per coordinate, so a
strategy's loss is sens(C)^2 ||A C^-1||_F^2. A b-banded C under b-min-separation: one
participation's sensitivity is the largest column norm (k participations: the root of the
largest sum of k squared column norms >= b apart).
Strategies are normalized to max column norm 1 (sigma = z S). `optimize_banded`: general
banded C (same paper, Section 4), O(n^3) per iteration; `optimize_banded_toeplitz`: Toeplitz
(McKenna et al., "Scaling up the banded matrix factorization mechanism"), O(n b). Cached in
memory (and on disk with `cache_dir`).
"""

import functools
import os

import numpy as np
from scipy import optimize as sp_optimize
from scipy import signal as sp_signal
from scipy.linalg import solve_triangular

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError


def _check_sizes(n, bands):
  validation.check_integer("n", n, 1)   # the number of steps
  validation.check_integer("bands", bands, 1)


def sqrt_prefix_coefficients(k):
  """r_j = binom(2j, j) / 4^j, j < k (float64 [k]): the Toeplitz square root of A
  (Fichtenberger et al. 2023); its first b terms start the banded optimization."""
  r = np.ones(k)
  for j in range(1, k):
    r[j] = r[j - 1] * (2 * j - 1) / (2 * j)
  return r


def toeplitz_matrix(coefs, n):
  """The n x n lower-triangular Toeplitz matrix (float64) whose first column starts with
  `coefs` (later entries 0; coefficients beyond n dropped)."""
  c = np.zeros(n)
  m = min(n, len(coefs))
  c[:m] = coefs[:m]
  idx = np.arange(n)[:, None] - np.arange(n)[None, :]
  return np.where(idx >= 0, c[np.clip(idx, 0, n - 1)], 0.0)


def num_bands(matrix, tol=0.0):
  """The number of bands b (an int, 0 for the zero matrix) of a square lower-triangular
  matrix: 1 + the largest i - j with |C[i, j]| > `tol`.

  Raises:
    ParameterValueError: the matrix is not lower triangular.
  """
  c = np.asarray(matrix)
  i, j = np.nonzero(np.abs(c) > tol)
  if np.any(i < j):
    k = int(np.argmax(j - i))
    raise ParameterValueError(f"`matrix` must be lower triangular. Received: a matrix of shape "
                              f"{c.shape} with entry [{i[k]}, {j[k]}] = {c[i[k], j[k]]!r}")
  return int((i - j).max()) + 1 if i.size else 0


def column_norms(matrix):
  """L2 norms of the columns of a 2-D `matrix` (float64 [columns])."""
  return np.linalg.norm(np.asarray(matrix, np.float64), axis=0)


def prefix_error(matrix):
  """||A C^-1||_F^2 / n (a float): mean squared prefix-sum error per step and coordinate per
  sigma^2 of the strategy C (lower triangular, invertible [n, n])."""
  c = np.asarray(matrix, np.float64)
  n = c.shape[0]
  inv = solve_triangular(c, np.eye(n), lower=True)
  return float(np.sum(np.cumsum(inv, axis=0) ** 2) / n)


# ---- Toeplitz banded ----------------------------------------------------------------------


def _toeplitz_loss_and_grad(coefs, n):
  """loss(c) = ||c||^2 sum_k (n - k) e_k^2 with e = cumsum of the inverse coefficients d of c
  (d = impulse response of 1 / c(z)), and its gradient: d d_k / d c_j = -(d * d)_{k-j}."""
  d = sp_signal.lfilter([1.0], coefs, np.eye(1, n)[0])   # of the unit impulse
  e = np.cumsum(d)
  w = n - np.arange(n, dtype=np.float64)
  f = float(np.sum(w * e * e))
  h = np.cumsum(sp_signal.lfilter([1.0], coefs, d))      # cumsum of (d * d)[:n]
  we = w * e
  b = len(coefs)
  df = np.array([-2.0 * np.dot(we[j:], h[:n - j]) for j in range(b)])
  sq = float(np.dot(coefs, coefs))
  return sq * f, 2.0 * coefs * f + sq * df


@functools.lru_cache(maxsize=64)
def _toeplitz_cached(n, bands, max_iter):
  x0 = sqrt_prefix_coefficients(bands)
  bounds = [(1e-3, None)] + [(None, None)] * (bands - 1)
  res = sp_optimize.minimize(_toeplitz_loss_and_grad, x0, args=(n,), jac=True,
                             method="L-BFGS-B", bounds=bounds,
                             options={"maxiter": max_iter, "gtol": 1e-10})
  c = res.x / np.linalg.norm(res.x)
  return tuple(float(v) for v in c)


def optimize_banded_toeplitz(n, bands, max_iter=500, cache_dir=None):
  """Toeplitz coefficients c (length `bands`, ||c|| = 1) minimizing ||A C^-1||_F^2 for n steps.

  `bands` is capped at n; `max_iter` L-BFGS iterations; `cache_dir`: on-disk cache (None:
  memory only). Returns float64 [bands].

  Raises:
    ParameterValueError: n or bands not an integer >= 1.
  """
  _check_sizes(n, bands)
  bands = min(int(bands), int(n))
  return _with_disk_cache(cache_dir, f"toeplitz_n{n}_b{bands}_it{max_iter}",
                          lambda: np.array(_toeplitz_cached(int(n), bands, int(max_iter))))


# ---- general banded (Choquette-Choo et al. 2023) ------------------------------------------


def _banded_loss_and_grad(theta, n, mask):
  """loss(P) = ||A C^-1||_F^2 with C = P diag(1 / ||P_j||) (columns normalized to 1).

  With X = C^-1: d loss / dC = -2 X^T A^T A X X^T; through the normalization,
  d loss / dP_j = (G_j - C_j <C_j, G_j>) / ||P_j||.
  """
  p = np.zeros([n, n])
  p[mask] = theta
  norms = np.linalg.norm(p, axis=0)
  c = p / norms
  x = solve_triangular(c, np.eye(n), lower=True)
  ax = np.cumsum(x, axis=0)
  loss = float(np.sum(ax * ax))
  at_ax = np.cumsum(ax[::-1], axis=0)[::-1]             # A^T (A X)
  g = -2.0 * x.T @ at_ax @ x.T
  gp = (g - c * np.sum(c * g, axis=0)) / norms
  return loss, gp[mask]


@functools.lru_cache(maxsize=32)
def _banded_cached(n, bands, max_iter):
  idx = np.arange(n)[:, None] - np.arange(n)[None, :]
  mask = (idx >= 0) & (idx < bands)
  theta0 = toeplitz_matrix(sqrt_prefix_coefficients(bands), n)[mask]
  res = sp_optimize.minimize(_banded_loss_and_grad, theta0, args=(n, mask), jac=True,
                             method="L-BFGS-B", options={"maxiter": max_iter, "gtol": 1e-9})
  p = np.zeros([n, n])
  p[mask] = res.x
  c = p / np.linalg.norm(p, axis=0)
  return c


def optimize_banded(n, bands, max_iter=300, cache_dir=None):
  """A general banded strategy C (n x n, `bands` bands, every column norm 1) minimizing
  ||A C^-1||_F^2 (Choquette-Choo et al. 2023, Section 4). O(n^3) per iteration: n <= ~1000.

  n <= 2048; arguments as `optimize_banded_toeplitz`'s. Returns float64 [n, n].

  Raises:
    ParameterValueError: n or bands not an integer >= 1, or n > 2048.
  """
  _check_sizes(n, bands)
  bands = min(int(bands), int(n))
  if n > 2048:
    raise ParameterValueError(f"optimize_banded is O(n^3) per iteration; n={n} is too large, use "
                              "optimize_banded_toeplitz")
  return _with_disk_cache(cache_dir, f"banded_n{n}_b{bands}_it{max_iter}",
                          lambda: _banded_cached(int(n), bands, int(max_iter)).copy())


def band_rows(matrix, bands):
  """The band of a lower-triangular banded [n, n] matrix as rows (float64 [n, b], b =
  `bands`): out[t, k] = C[t, t - k] (0 if t < k)."""
  c = np.asarray(matrix, np.float64)
  n = c.shape[0]
  out = np.zeros([n, bands])
  for k in range(bands):
    out[k:, k] = np.diagonal(c, -k)
  return out


def _with_disk_cache(cache_dir, key, compute):
  if cache_dir is None:
    return compute()
  path = os.path.join(cache_dir, f"tf_dpiter_strategy_{key}.npy")
  if os.path.exists(path):
    return np.load(path)
  value = compute()
  os.makedirs(cache_dir, exist_ok=True)
  tmp = f"{path}.tmp.npy"
  np.save(tmp, value)
  os.replace(tmp, path)
  return value
