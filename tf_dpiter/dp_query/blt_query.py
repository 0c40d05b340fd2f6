"""Buffered linear Toeplitz (BLT) query (`blt_strategy`): the noise of step t is sigma w_t with
C w = Z, w_t = z_t - sum_i omega_i s_i, s_i <- theta_i s_i + w_t (one buffer per term).

Privacy: a post-processing of C G + sigma Z over the horizon n (step n + 1 refused);
sigma = z S Delta, Delta = `blt_strategy.equivalent_sensitivity` under min-separation. Each
step reports a `MatrixGaussianEvent`, accounted without amplification.
"""


import collections

import numpy as np
import tensorflow as tf

from tf_dpiter.dp_query import band_mf_query
from tf_dpiter.dp_query import blt_strategy
from tf_dpiter.dp_query import correlated_events
from tf_dpiter.dp_query import randomness
from tf_dpiter.dp_query import serialization
from tf_dpiter.errors import ParameterValueError


@serialization.register_query()
class BLTQuery(band_mf_query.CorrelatedNoiseQuery):
  """Sum of records clipped to S plus BLT-correlated noise C^-1 Z sigma."""

  _GlobalState = collections.namedtuple(
      "_GlobalState", ["l2_norm_clip", "stddev", "step", "buffers"])

  def __init__(self, l2_norm_clip, noise_multiplier, template, num_steps, num_buffers=4,
               min_separation=1, theta=None, omega=None, seed=None):
    """Args:
      l2_norm_clip: S.
      noise_multiplier: z = sigma / (Delta S).
      template: a record's structure (tensors, variables, TensorSpecs or shape lists).
      num_steps: n, the horizon (steps beyond it are refused).
      num_buffers: buffers of an optimized strategy (ignored when theta/omega are given).
      min_separation: b, the least gap between two participations the sampling guarantees.
      theta: an explicit BLT's theta, each in (0, 1) (with omega); optimized when None.
      omega: an explicit BLT's omega, as long as theta; optimized when None.
      seed: tests only (not private).

    Raises:
      ParameterValueError: only one of theta / omega, theta outside (0, 1) or of another length than
        omega, or a bad argument of the optimization.
    """
    self._init_common(l2_norm_clip, noise_multiplier, template, seed)
    self._num_steps, self._min_sep = int(num_steps), int(min_separation)
    self._num_buffers = int(num_buffers)
    if (theta is None) != (omega is None):
      raise ParameterValueError("give both `theta` and `omega`, or neither. Received: "
                                f"theta={theta!r}, omega={omega!r}")
    if theta is None:
      theta, omega = blt_strategy.optimize_blt(self._num_steps, self._num_buffers, self._min_sep,
                                               -(-self._num_steps // self._min_sep))
    self._theta = np.asarray(theta, np.float64).reshape(-1)
    self._omega = np.asarray(omega, np.float64).reshape(-1)
    if self._theta.shape != self._omega.shape or np.any((self._theta <= 0) | (self._theta >= 1)):
      raise ParameterValueError(f"theta must lie in (0, 1) and match omega's length, got theta="
                                f"{self._theta.tolist()}, omega={self._omega.tolist()}")
    coefs = blt_strategy.strategy_coefficients(self._theta, self._omega, self._num_steps)
    self._sensitivity = blt_strategy.equivalent_sensitivity(coefs, self._min_sep)

  def get_config(self):
    """The constructor's arguments as plain values, theta and omega included (a rebuilt query
    does not optimize again).

    Returns:
      a dict that `BLTQuery(**config)` rebuilds the query from.
    """
    return self._config(num_steps=self._num_steps, num_buffers=self._num_buffers,
                        min_separation=self._min_sep, theta=self._theta.tolist(),
                        omega=self._omega.tolist())

  @property
  def theta(self):
    """The BLT's decay rates theta_i in (0, 1) (numpy copy)."""
    return self._theta.copy()

  @property
  def omega(self):
    """The BLT's output weights omega_i (numpy copy)."""
    return self._omega.copy()

  @property
  def equivalent_sensitivity(self):
    """Delta (per unit clip), computed from the strategy's coefficients."""
    return self._sensitivity

  def initial_global_state(self):
    """(S, sigma = z Delta S, step 0, one zero buffer per term [buffers, d]).

    Returns:
      the query's _GlobalState.
    """
    return self._initial_state(self._sensitivity,
                               tf.zeros([len(self._theta), self._size], tf.float32))

  def get_noised_result(self, sample_state, global_state):
    """The sum plus sigma w_t, w_t = z_t - sum_i omega_i s_i, then s_i <- theta_i s_i + w_t.

    Args:
      sample_state: the clipped sum (a nest shaped like the template).
      global_state: the query's global state.

    Returns:
      (noised sum, next global state, (MatrixGaussianEvent,)).

    Raises:
      tf.errors.InvalidArgumentError: a step beyond num_steps (the sensitivity's horizon).
    """
    check = tf.debugging.assert_less(
        global_state.step, tf.constant(self._num_steps, tf.int64),
        message=f"BLTQuery: the strategy's sensitivity covers num_steps={self._num_steps} steps")
    with tf.control_dependencies([check]):
      z = randomness.normal(self._generator, [self._size], tf.float32)
    omega = tf.constant(self._omega, tf.float32)[:, tf.newaxis]
    theta = tf.constant(self._theta, tf.float32)[:, tf.newaxis]
    w = z - tf.reduce_sum(omega * global_state.buffers, axis=0)
    new_buffers = theta * global_state.buffers + w[tf.newaxis]
    result = band_mf_query.add_flat_noise(sample_state, w * global_state.stddev)
    new_state = self._GlobalState(global_state.l2_norm_clip, global_state.stddev,
                                  global_state.step + 1, new_buffers)
    event = correlated_events.MatrixGaussianEvent(global_state.l2_norm_clip, global_state.stddev,
                                                  self._sensitivity, self._min_sep)
    return result, new_state, (event,)
