"""Banded matrix factorization query, BandMF (Choquette-Choo et al., "(Amplified) Banded
Matrix Factorization: A unified approach to private training", Sections 2-4).

Step t releases g_t plus row t of W = C^-1 Z sigma (C lower triangular, b bands, Z iid
N(0, 1)): w_t = (z_t sigma - sum_{k=1}^{b-1} C[t, t-k] w_{t-k}) / C[t, t], from b - 1 kept
noise vectors (O(b d) memory). Privacy: a post-processing of C G + Z sigma; C has max column
norm zeta = 1, so z = sigma / (zeta S). b = 1 is `GaussianSumQuery`'s noise. Each step reports
a `BandedGaussianEvent`, accounted under b-min-separation (cyclic Poisson) sampling only.
"""

import collections

import numpy as np
import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import correlated_events
from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import gaussian_query
from tf_dpiter.dp_query import matrix_factorization as mf
from tf_dpiter.dp_query import randomness
from tf_dpiter.dp_query import serialization
from tf_dpiter.errors import ParameterValueError

STRATEGIES = ("toeplitz", "banded")


def template_shapes(template):
  """[(list of ints, dtype name)] of the leaves (tf.nest order) of a record template: a nest
  of tensors, variables or TensorSpecs, or the list `template_config` returns.

  Raises:
    ParameterValueError: a leaf whose shape is not fully defined.
  """
  if isinstance(template, list) and template and all(
      isinstance(t, dict) and set(t) == {"shape", "dtype"} for t in template):
    return [([int(s) for s in t["shape"]], tf.as_dtype(t["dtype"]).name) for t in template]
  out = []
  for t in tf.nest.flatten(template):
    shape = t.shape if hasattr(t, "shape") else np.shape(t)
    dtype = tf.as_dtype(getattr(t, "dtype", tf.float32)).name
    if not tf.TensorShape(shape).is_fully_defined():
      raise ParameterValueError(f"template leaves must have fully defined shapes, got {shape}")
    out.append(([int(s) for s in shape], dtype))
  return out


def template_config(shapes):
  """The JSON-able form of `template_shapes`' output, read back by it: a list of
  {"shape": [...], "dtype": name} dicts."""
  return [{"shape": list(s), "dtype": d} for s, d in shapes]


def add_flat_noise(structure, flat_noise):
  """structure + flat_noise split over its leaves (tf.nest order), in float32 (float64 leaves
  in float64), cast back to each leaf's dtype; `flat_noise` is [d], d the nest's values."""
  leaves = [tf.convert_to_tensor(v) for v in tf.nest.flatten(structure)]
  sizes = [int(np.prod(v.shape)) for v in leaves]
  parts = tf.split(flat_noise, sizes) if len(leaves) > 1 else [flat_noise]
  out = []
  for leaf, part in zip(leaves, parts):
    wide = tf.float64 if leaf.dtype == tf.float64 else tf.float32
    noised = tf.cast(leaf, wide) + tf.cast(tf.reshape(part, tf.shape(leaf)), wide)
    out.append(tf.cast(noised, leaf.dtype))
  return tf.nest.pack_sequence_as(structure, out)


def make_strategy(num_steps, num_bands, strategy="toeplitz", cache_dir=None):
  """Band rows [n, b] (rows[t, k] = C[t, t-k]) of an optimized strategy, max column norm 1.

  `strategy`: "toeplitz" (b coefficients, usable for any n and for steps beyond n),
  "banded" (general banded, n <= 2048), or an explicit lower-triangular banded matrix
  (normalized here). Returns (rows, extendable: whether steps beyond n may reuse the last row).

  Raises:
    ParameterValueError: an unknown strategy name, or a matrix that is not square with a
      positive diagonal.
  """
  if isinstance(strategy, str):
    if strategy not in STRATEGIES:
      raise ParameterValueError(f"strategy must be one of {STRATEGIES} or a matrix, got {strategy!r}")
    if strategy == "toeplitz":
      c = mf.optimize_banded_toeplitz(num_steps, num_bands, cache_dir=cache_dir)
      return mf.band_rows(mf.toeplitz_matrix(c, len(c)), len(c)), True
    matrix = mf.optimize_banded(num_steps, num_bands, cache_dir=cache_dir)
  else:
    matrix = np.asarray(strategy, np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
      raise ParameterValueError(f"strategy matrix must be square, got shape {matrix.shape}")
    if np.any(np.diag(matrix) <= 0):
      raise ParameterValueError("`strategy` must have a positive diagonal (invertible). Received: "
                                f"a diagonal with minimum {np.diag(matrix).min()!r}")
  b = mf.num_bands(matrix)
  zeta = mf.column_norms(matrix).max()
  return mf.band_rows(matrix / zeta, b), False


class CorrelatedNoiseQuery(dp_query.SumAggregationDPQuery):
  """Shared part of the correlated-noise queries: records clipped to S (global L2 norm, by
  `dp_query.clip_factors`, the one place of the clip arithmetic), a global state (l2_norm_clip,
  stddev, step, noise state), and the noise added flat over the record's leaves. Subclasses
  define `_GlobalState` and `get_noised_result`."""

  def _init_common(self, l2_norm_clip, noise_multiplier, template, seed):
    self._l2_norm_clip = validation.check_clip_norm("l2_norm_clip", l2_norm_clip)
    self._noise_multiplier = validation.check_nonnegative(
        "noise_multiplier", noise_multiplier, allow_inf=False)
    self._shapes = template_shapes(template)
    self._size = int(sum(np.prod(s) for s, _ in self._shapes))
    self._seed = seed
    self._generator = randomness.make_generator(seed)

  def _config(self, **fields):
    """The shared constructor arguments (S, z, template, seed) as plain values, and `fields`."""
    p = serialization.plain
    return {"l2_norm_clip": p(self._l2_norm_clip), "noise_multiplier": p(self._noise_multiplier),
            "template": template_config(self._shapes), "seed": p(self._seed), **fields}

  def _initial_state(self, sensitivity, noise_state):
    """Global state with stddev = noise_multiplier x S x sensitivity (per unit clip)."""
    stddev = gaussian_query.gaussian_stddev(self._l2_norm_clip,
                                            self._noise_multiplier) * float(sensitivity)
    return self._GlobalState(tf.constant(self._l2_norm_clip, tf.float32),
                             tf.constant(stddev, tf.float32), tf.constant(0, tf.int64),
                             noise_state)

  @property
  def noise_generator(self):
    """The query's Philox `tf.random.Generator` (its `state` variable is what a checkpoint
    must keep for a resumed run to draw the noise an uninterrupted one would have)."""
    return self._generator

  # The clip S, the per-record L2 clip of the records and the metrics {l2_norm_clip, stddev}
  # are the Gaussian sum's (params is S; the correlated queries do not adapt S): one
  # definition each.
  derive_sample_params = gaussian_query.GaussianSumQuery.derive_sample_params
  preprocess_record = gaussian_query.GaussianSumQuery.preprocess_record
  record_clip_factors = gaussian_query.GaussianSumQuery.record_clip_factors
  derive_metrics = gaussian_query.GaussianSumQuery.derive_metrics


@serialization.register_query()
class BandMFQuery(CorrelatedNoiseQuery):
  """Sum of records clipped to S, plus banded correlated noise C^-1 Z sigma (BandMF)."""

  _GlobalState = collections.namedtuple(
      "_GlobalState", ["l2_norm_clip", "stddev", "step", "history"])

  def __init__(self, l2_norm_clip, noise_multiplier, template, num_bands=1, num_steps=None,
               strategy="toeplitz", seed=None, cache_dir=None):
    """Args:
      l2_norm_clip: S, per record.
      noise_multiplier: z = sigma / (zeta S); zeta = 1 (normalized strategy).
      template: a record's structure (tensors, variables, TensorSpecs or shape lists).
      num_bands: b (1 = DP-SGD). Sampling must keep participations >= b steps apart.
      num_steps: n, the steps the strategy is optimized for (required unless b = 1 or an
        explicit matrix is given).
      strategy: "toeplitz", "banded", or a lower-triangular banded matrix.
      seed: tests only (not private).
      cache_dir: the directory of the on-disk strategy cache (None: the default one).

    Raises:
      ParameterValueError: a bad argument, named.
    """
    self._init_common(l2_norm_clip, noise_multiplier, template, seed)
    if isinstance(strategy, str) and num_steps is None:
      if num_bands != 1:
        raise ParameterValueError(f"num_steps is required to optimize a strategy of {num_bands} bands")
      num_steps = 1
    self._config_strategy = strategy if isinstance(strategy, str) else np.asarray(strategy).tolist()
    self._num_steps = num_steps
    self._requested_bands = int(num_bands)
    self._cache_dir = cache_dir
    rows, self._extendable = make_strategy(num_steps, int(num_bands), strategy, cache_dir)
    self._rows_np = rows
    self._num_bands = rows.shape[1]
    self._rows = tf.constant(rows, tf.float32)
    self._column_norm = self._compute_column_norm()

  def get_config(self):
    return self._config(num_bands=self._requested_bands, num_steps=self._num_steps,
                        strategy=self._config_strategy, cache_dir=self._cache_dir)

  @property
  def num_bands(self):
    """b, the bands of the strategy in use (<= the requested number, and <= num_steps)."""
    return self._num_bands

  @property
  def band_rows(self):
    """rows[t, k] = C[t, t-k] of the normalized strategy (numpy [n, b])."""
    return self._rows_np.copy()

  @property
  def column_norm(self):
    """zeta: the largest column norm of the strategy (1 after normalization), from the matrix."""
    return self._column_norm

  def _compute_column_norm(self):
    n = self._rows_np.shape[0]
    dense = np.zeros([n, n])
    for k in range(self._num_bands):
      dense[np.arange(k, n), np.arange(0, n - k)] = self._rows_np[k:, k]
    if self._extendable:  # Toeplitz: a full column holds every coefficient
      return float(np.linalg.norm(self._rows_np[-1]))
    return float(mf.column_norms(dense).max())

  def initial_global_state(self):
    """(S, sigma = z zeta S, step 0, history of b - 1 zero noise vectors [b - 1, d]).

    Returns:
      the query's _GlobalState.
    """
    return self._initial_state(self.column_norm,
                               tf.zeros([self._num_bands - 1, self._size], tf.float32))

  def _row(self, step):
    n = self._rows_np.shape[0]
    if self._extendable:
      return tf.gather(self._rows, tf.minimum(step, n - 1))
    check = tf.debugging.assert_less(
        step, tf.constant(n, tf.int64),
        message=f"BandMFQuery: the strategy was built for num_steps={n}; a further step has "
                "no row (use strategy='toeplitz' or a longer strategy)")
    with tf.control_dependencies([check]):
      return tf.gather(self._rows, step)

  def get_noised_result(self, sample_state, global_state):
    """The sum plus sigma w_t, w_t = (z_t - sum_k C[t, t-k] w_{t-k}) / C[t, t] (module doc).

    Args:
      sample_state: the clipped sum (a nest shaped like the template).
      global_state: the query's global state.

    Returns:
      (noised sum, next global state, (BandedGaussianEvent,)).

    Raises:
      tf.errors.InvalidArgumentError: a non-extendable strategy's step beyond num_steps.
    """
    row = self._row(global_state.step)
    z = randomness.normal(self._generator, [self._size], tf.float32)
    hist = global_state.history                     # w_{t-1}, ..., w_{t-b+1} (units of sigma)
    if self._num_bands > 1:
      z = z - tf.tensordot(row[1:], hist, axes=1)
    w = z / row[0]                                  # w_t = (C^-1 Z)_t
    result = add_flat_noise(sample_state, w * global_state.stddev)
    # keep b - 1 vectors (none for b = 1: the state's shape must not change across steps)
    new_hist = tf.concat([w[tf.newaxis], hist], axis=0)[:self._num_bands - 1]
    new_state = self._GlobalState(global_state.l2_norm_clip, global_state.stddev,
                                  global_state.step + 1, new_hist)
    event = correlated_events.BandedGaussianEvent(
        global_state.l2_norm_clip, global_state.stddev, self.column_norm, self._num_bands)
    return result, new_state, (event,)
