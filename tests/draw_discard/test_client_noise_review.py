"""The local-DP client step (Algorithm 1 of Pihur et al., "Differentially-Private Draw and
Discard Machine Learning", Section III-B) measured: the real numpy and TensorFlow client steps
run on fixed inputs, their noise compared with the stated scale, a neighbouring pair of
client records compared with the stated per-weight epsilon, and the float32 lattice
distinguisher (Mironov, "On Significance of the Least Significant Bits for Differential
Privacy") run against the TensorFlow client.

Neighbouring relation: one client's single record replaced (feature-level local DP, per weight
and per update, as the paper states). Every coordinate of one call is an independent sample
of the same one-weight mechanism (the record is the same across coordinates), so one call
gives p samples.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.draw_discard import calibration, client

GAMMA, EPS, CLIP = 0.5, 1.0, 0.5
P = 40_000


def _pair(p, rng):
  """(w [p] float64 with full low bits, x [1, p], y_D, y_N): a linear-model record pair whose
  clipped gradients are -c and +c on every weight, the largest change Algorithm 1 allows."""
  w = rng.uniform(-1.0, 1.0, p) / p  # |x . w| < 0.5: the gradient x.w - y clips at -/+ c
  return w, np.ones((1, p)), np.array([1.0]), np.array([-1.0])


def _steps(which, w, x, y):
  if which == "tf":
    upd = client.make_tf_client_update("linear", GAMMA, EPS, CLIP,
                                       generator=tf.random.Generator.from_non_deterministic_state())
    return upd(w, x, y).numpy()
  return client.client_update(w, x, y, family="linear", gamma=GAMMA, epsilon=EPS, clip=CLIP,
                              rng=np.random.default_rng())


@pytest.mark.parametrize("which", ["numpy", "tf"])
def test_noise_scale_matches_the_stated_laplace(which):
  # 40,000 samples: relative SE of the std ~ sqrt(5/4/40000) = 0.0056 (Laplace kurtosis 6),
  # of E|X| ~ 1/sqrt(40000) = 0.005; tolerances 0.03.
  rng = np.random.default_rng()
  w, x, y, _ = _pair(P, rng)
  noise = _steps(which, w, x, y) - (w + GAMMA * CLIP)
  b = calibration.laplace_scale(GAMMA, EPS, CLIP)
  assert b == pytest.approx(2 * GAMMA * CLIP / EPS)
  assert abs(noise.std() / calibration.noise_std("laplace", GAMMA, EPS, CLIP) - 1) < 0.03
  assert abs(np.abs(noise).mean() / b - 1) < 0.03  # Laplace: E|X| = b = std / sqrt(2)
  assert abs(noise.mean()) < 5 * b * math.sqrt(2 / P)


@pytest.mark.parametrize("which", ["numpy", "tf"])
def test_neighbouring_records_empirical_epsilon(which):
  # Output histograms of the two records (bins of b / 2, counts >= 400 in both): the largest
  # log ratio estimates epsilon; for Laplace it is exactly EPS beyond the two means.
  # SE of one bin's log ratio <= sqrt(2/400) = 0.07; 0.25 allows the max over ~14 bins.
  rng = np.random.default_rng()
  w, x, y_d, y_n = _pair(P, rng)
  out_d = _steps(which, w, x, y_d) - w
  out_n = _steps(which, w, x, y_n) - w
  b = calibration.laplace_scale(GAMMA, EPS, CLIP)
  edges = np.arange(-8 * b, 8 * b + 1e-9, b / 2)
  hd, _ = np.histogram(out_d, edges)
  hn, _ = np.histogram(out_n, edges)
  ok = (hd >= 400) & (hn >= 400)
  eps_hat = np.max(np.abs(np.log(hd[ok] / hn[ok])))
  assert ok.sum() >= 8
  assert EPS - 0.25 < eps_hat < EPS + 0.25, eps_hat


@pytest.mark.parametrize("which", ["numpy", "tf"])
def test_low_bits_do_not_reveal_the_record(which):
  # Adversary I knows w and both candidate records: out - (w - gamma G) is the noise for the
  # true record. float32 noise added to float64 weights makes that residual a float32 value
  # (before the fix: ~93% of coordinates for the true record, 0% for the other: the record
  # is read off with near certainty). With float64 noise neither record's residual is.
  rng = np.random.default_rng()
  w, x, y_d, y_n = _pair(4000, rng)
  out = _steps(which, w, x, y_d)

  def float32_share(a):
    r = out - a
    return np.mean(np.float64(np.float32(r)) == r)

  true_share = float32_share(w + GAMMA * CLIP)   # record D: G = -c
  other_share = float32_share(w - GAMMA * CLIP)  # record N: G = +c
  assert true_share < 0.01 and other_share < 0.01, (true_share, other_share)


@pytest.mark.parametrize("which", ["numpy", "tf"])
@pytest.mark.parametrize("y", [[np.nan, 1.0], [np.inf, 0.0], [1e308, -1e308]])
def test_a_non_finite_response_leaves_the_update_noise_protected(which, y):
  # Before: a NaN response made every weight NaN, through the noise: the server saw, without
  # noise, that the client's data held a NaN. Now a NaN gradient coordinate counts as 0, so
  # |G_j| <= c and the output is Laplace noise around a point within gamma c of w.
  w = np.linspace(-0.3, 0.3, 3)
  x = np.array([[0.5, 0.2, 1.0], [0.1, 0.9, 1.0]])
  y = np.array(y)
  if which == "tf":
    quiet = client.make_tf_client_update("linear", GAMMA, None, CLIP)(w, x, y).numpy()
    noisy = client.make_tf_client_update("linear", GAMMA, EPS, CLIP)(w, x, y).numpy()
  else:
    kw = dict(family="linear", gamma=GAMMA, clip=CLIP)
    quiet = client.client_update(w, x, y, epsilon=None, **kw)
    noisy = client.client_update(w, x, y, epsilon=EPS, **kw)
  assert np.all(np.isfinite(quiet)) and np.all(np.isfinite(noisy))
  assert np.all(np.abs(quiet - w) <= GAMMA * CLIP * (1 + 1e-12))


def test_spec_update_refuses_a_non_finite_response_before_anything_is_sent():
  from tf_dpiter.draw_discard import cli
  spec = cli.dense_spec(3, epsilon=1.0, gamma=0.01)
  x = {"x": np.full((2, 2), 0.5)}
  with pytest.raises(ValueError, match="`y` must hold finite responses"):
    client.spec_update(spec, np.zeros(3), x, [np.nan, 1.0])
  assert np.all(np.isfinite(client.spec_update(spec, np.zeros(3), x, [0.0, 1.0])))


def test_tf_client_laplace_from_os_randomness():
  # The privacy core's SecureRandom (os.urandom words) drives the same float64 sampler.
  from tf_dpiter import dp_query
  upd = client.make_tf_client_update("linear", GAMMA, EPS, CLIP,
                                     generator=dp_query.make_generator(secure=True))
  rng = np.random.default_rng()
  w, x, y, _ = _pair(P, rng)
  noise = upd(w, x, y).numpy() - (w + GAMMA * CLIP)  # the true record's residual
  assert abs(noise.std() / calibration.noise_std("laplace", GAMMA, EPS, CLIP) - 1) < 0.03
  assert np.mean(np.float64(np.float32(noise)) == noise) < 0.01
