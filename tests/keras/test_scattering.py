"""Scattering2D: shapes, the filter bank's energy bounds, an independent spatial-domain
reference, translation near-invariance, XLA."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.layers import Scattering2D
from tf_dpiter.keras.layers.scattering import filter_bank
from tf_dpiter.keras.layers.scattering import padded_size


def _ring(size=28, shift=(0, 0)):
  """A smooth ring (a digit-like stroke), optionally shifted by whole pixels."""
  u, v = np.mgrid[0:size, 0:size].astype(np.float64)
  r = np.hypot(u - size / 2 + 0.5 - shift[0], v - size / 2 + 0.5 - shift[1])
  return np.exp(-((r - size / 5) ** 2) / 2.0).astype(np.float32)


def test_output_shape_mnist_81_channels_at_7x7():
  x = np.random.RandomState(0).rand(3, 28, 28).astype(np.float32)
  layer = Scattering2D(J=2, L=8)
  assert layer.num_coefficients == 81
  assert tuple(layer(x).shape) == (3, 7, 7, 81)
  assert tuple(layer(x[..., None]).shape) == (3, 7, 7, 81)
  rgb = np.random.RandomState(1).rand(2, 32, 32, 3).astype(np.float32)
  assert tuple(layer(rgb).shape) == (2, 8, 8, 243) == layer.compute_output_shape((2, 32, 32, 3))
  assert layer.compute_output_shape((None, 28, 28)) == (None, 7, 7, 81)
  assert not layer.weights
  assert Scattering2D(J=3, L=4).num_coefficients == 1 + 3 * 4 + 16 * 3


def test_filter_bank_littlewood_paley_and_dc():
  m = padded_size(28, 2)
  psi, phi = filter_bank(m, m, J=2, L=8)
  lp = sum((p[0].astype(np.float64) ** 2).sum(axis=0) for p in psi)
  flipped = np.roll(np.flip(lp, (0, 1)), 1, (0, 1))     # lp(-omega) on the DFT grid
  total = phi[0].astype(np.float64) ** 2 + 0.5 * (lp + flipped)
  # For real images the wavelet transform (x * phi, x * psi_{j,theta}) is then nonexpansive
  # (upper bound 1) and keeps a fixed share of every frequency's energy (lower bound).
  assert total.max() <= 1.0 + 1e-5 and total.min() >= 0.1
  assert abs(phi[0][0, 0] - 1.0) < 1e-6                  # the low-pass keeps the mean
  for p in psi:
    assert np.abs(p[0][:, 0, 0]).max() < 1e-6           # wavelets have zero mean
  # nonexpansive on an actual image (Parseval on the padded grid)
  x = np.pad(_ring(), 4, mode="reflect").astype(np.float64)
  xf = np.fft.fft2(x)
  energy = sum(np.sum(np.abs(np.fft.ifft2(xf * f)) ** 2) for p in psi for f in p[0])
  energy += np.sum(np.abs(np.fft.ifft2(xf * phi[0])) ** 2)
  assert energy <= np.sum(x ** 2) * (1 + 1e-5)


def _spatial_morlet(m, sigma, theta, xi, slant):
  """The Morlet filter in space, written out per periodic copy (Bruna and Mallat, Eq. 19)."""
  c, s = math.cos(theta), math.sin(theta)
  def gabor(freq):
    out = np.zeros((m, m), np.complex128)
    for a in range(-2, 3):
      for b in range(-2, 3):
        u, v = np.mgrid[0:m, 0:m].astype(np.float64)
        u, v = u + a * m, v + b * m
        along, across = c * u + s * v, -s * u + c * v   # coordinates in the rotated frame
        quad = (along ** 2 + (slant ** 2) * across ** 2) / (2 * sigma ** 2)
        out += np.exp(-quad + 1j * freq * along)
    return out / (2 * math.pi * sigma ** 2 / slant)
  wave, env = gabor(xi), gabor(0.0)
  return wave - wave.sum() / env.sum() * env


def _circular_conv(x, f):
  """sum_k x[k] f[n - k] on the torus, by explicit shifts (no FFT)."""
  out = np.zeros(x.shape, np.complex128)
  for a in range(x.shape[0]):
    for b in range(x.shape[1]):
      if x[a, b] != 0:
        out += x[a, b] * np.roll(f, (a, b), axis=(0, 1))
  return out


def _spatial_reference(img, J=2, L=8):
  """Full-resolution scattering by spatial circular convolutions, subsampled at the end."""
  pad = padded_size(img.shape[0], J) - img.shape[0]
  x = np.pad(img.astype(np.float64), (pad // 2, (pad + 1) // 2), mode="reflect")
  m = x.shape[0]
  # the low-pass: the plain periodized Gaussian of width 0.8 2^(J - 1)
  u, v = np.mgrid[0:m, 0:m].astype(np.float64)
  sig = 0.8 * 2 ** (J - 1)
  phi = sum(np.exp(-((u + a * m) ** 2 + (v + b * m) ** 2) / (2 * sig ** 2))
            for a in range(-2, 3) for b in range(-2, 3)) / (2 * math.pi * sig ** 2)
  psis = [[_spatial_morlet(m, 0.8 * 2 ** j, (int(L - L / 2 - 1) - t) * math.pi / L,
                           0.75 * math.pi / 2 ** j, 4.0 / L) for t in range(L)]
          for j in range(J)]
  k = 2 ** J
  low = lambda y: np.real(_circular_conv(y, phi))[::k, ::k][1:-1, 1:-1]  # noqa: E731
  s0, s1, s2 = [low(x)], [], []
  for j1 in range(J):
    for p1 in psis[j1]:
      u1 = np.abs(_circular_conv(x, p1))
      s1.append(low(u1))
      for j2 in range(j1 + 1, J):
        for p2 in psis[j2]:
          s2.append(low(np.abs(_circular_conv(u1, p2))))
  return np.stack(s0 + s1 + s2, axis=-1), L


def test_matches_an_independent_spatial_convolution():
  img = _ring(12)
  img += np.random.RandomState(0).rand(12, 12).astype(np.float32) * 0.3
  ref, L = _spatial_reference(img)
  out = Scattering2D(J=2, L=L)(img[None])[0].numpy()
  assert out.shape == ref.shape == (3, 3, 81)
  # S0 and the first-order coefficients of scale j1 = 0 involve no intermediate subsampling:
  # the FFT algorithm is exact there
  exact = 1 + L
  np.testing.assert_allclose(out[..., :exact], ref[..., :exact], rtol=1e-4, atol=1e-5)
  # j1 = 1 and second order: the FFT algorithm subsamples |x * psi| before the next
  # convolution (Kymatio's, and Bruna and Mallat's, Section 3.3), an approximation
  rel = np.linalg.norm(out[..., exact:] - ref[..., exact:]) / np.linalg.norm(ref[..., exact:])
  print("relative deviation of the subsampled orders:", rel)
  assert rel < 0.03


def test_translation_near_invariance_grows_with_the_scale():
  x0, x1 = _ring(32), _ring(32, shift=(1, 1))
  pixel_change = np.linalg.norm(x1 - x0) / np.linalg.norm(x0)
  changes = []
  for J in (1, 2, 3):
    layer = Scattering2D(J=J, L=8)
    s0, s1 = layer(x0[None])[0].numpy(), layer(x1[None])[0].numpy()
    changes.append(np.linalg.norm(s1 - s0) / np.linalg.norm(s0))
  # invariant to translations small against 2^J (Bruna and Mallat, Section 2.2): the
  # features move less than the pixels, and less as J grows
  assert pixel_change > 0.5
  assert pixel_change > changes[0] > changes[1] > changes[2], (pixel_change, changes)
  assert changes[2] < 0.35 * pixel_change, (pixel_change, changes)


def test_xla_equals_eager_and_config_round_trip():
  x = tf.constant(np.random.RandomState(2).rand(4, 28, 28).astype(np.float32))
  layer = Scattering2D(J=2, L=8)
  eager = layer(x).numpy()
  xla = tf.function(layer, jit_compile=True)(x).numpy()
  np.testing.assert_allclose(xla, eager, rtol=1e-4, atol=1e-6)
  clone = Scattering2D.from_config(layer.get_config())
  assert (clone.J, clone.L, clone.max_order) == (2, 8, 2)
  model = keras.Sequential([keras.Input((28, 28)), Scattering2D(J=2, L=8)])
  np.testing.assert_allclose(model(x).numpy(), eager, rtol=1e-5, atol=1e-6)


def test_first_order_only_and_errors():
  x = np.random.RandomState(3).rand(2, 28, 28).astype(np.float32)
  full = Scattering2D(J=2, L=8)(x).numpy()
  first = Scattering2D(J=2, L=8, max_order=1)(x).numpy()
  np.testing.assert_allclose(first, full[..., :17], rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="J"):
    Scattering2D(J=0)
  with pytest.raises(ValueError, match="max_order"):
    Scattering2D(max_order=3)
  with pytest.raises(ValueError, match="at least 8 x 8"):
    Scattering2D(J=3)(np.zeros((1, 6, 6), np.float32))
