"""The 2D wavelet scattering transform as a Keras preprocessing layer (data-independent).

Scattering coefficients of an image x (Bruna and Mallat, "Invariant Scattering Convolution
Networks", IEEE TPAMI 2013, Section 3; Oyallon and Mallat, "Deep Roto-Translation Scattering
for Object Classification", CVPR 2015, Section 2), with Morlet wavelets psi_{j,theta} at
scales 2^j (j < J) and L angles, and a Gaussian low-pass phi_J:

  S0 x = x * phi_J,
  S1 x = |x * psi_{j1,t1}| * phi_J,
  S2 x = ||x * psi_{j1,t1}| * psi_{j2,t2}| * phi_J   (j1 < j2),

each subsampled by 2^J: 1 + J L + L^2 J (J - 1) / 2 channels (81 for J = 2, L = 8) at
(H / 2^J) x (W / 2^J). The filters (Morlet with slant 4 / L, sigma = 0.8 2^j, centre
frequency 3 pi / (4 2^j)) and the algorithm (reflect padding, products in the Fourier domain,
subsampling by periodization of the spectrum, filters periodized to the coarser grids) are
those of Kymatio (Andreux et al., "Kymatio: Scattering Transforms in Python", JMLR 2020,
Section 3), reimplemented in TensorFlow (FFTs; static shapes, runs under XLA).

Features for DP-SGD as in Tramer and Boneh, "Differentially Private Learning Needs Better
Features (or Much More Data)", ICLR 2021, Section 3 (J = 2). The transform has no trainable
weights and does not look at the data set, so it costs no privacy: the guarantee of the model
trained on S x is the DP-SGD guarantee of that training.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from tf_dpiter.errors import ParameterValueError


def _gabor(m, n, sigma, theta, xi, slant=1.0):
  """Spatial Gabor g_sigma(u) exp(i xi . u) on an m x n grid, periodized over 5 x 5 copies."""
  rot = np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
  curv = rot @ np.diag([1.0, slant * slant]) @ rot.T / (2.0 * sigma * sigma)
  xs = (np.arange(m)[None, :] + m * np.arange(-2, 3)[:, None]).astype(np.float64)
  ys = (np.arange(n)[None, :] + n * np.arange(-2, 3)[:, None]).astype(np.float64)
  xx = xs[:, None, :, None]
  yy = ys[None, :, None, :]
  arg = (-(curv[0, 0] * xx * xx + (curv[0, 1] + curv[1, 0]) * xx * yy + curv[1, 1] * yy * yy)
         + 1j * xi * (xx * math.cos(theta) + yy * math.sin(theta)))
  return np.exp(arg).sum(axis=(0, 1)) / (2.0 * math.pi * sigma * sigma / slant)


def _morlet(m, n, sigma, theta, xi, slant):
  """Gabor minus a multiple of its envelope, so that the filter has zero mean."""
  wave = _gabor(m, n, sigma, theta, xi, slant)
  envelope = _gabor(m, n, sigma, theta, 0.0, slant)
  return wave - wave.sum() / envelope.sum() * envelope


def _periodize(fourier, res):
  """The spectrum of a filter for a grid 2^res times coarser: high band cut, then aliased."""
  m, n = fourier.shape
  k = 2 ** res
  masked = fourier.copy()
  start_x, len_x = int(m * 2.0 ** (-res - 1)), int(m * (1 - 2.0 ** -res))
  start_y, len_y = int(n * 2.0 ** (-res - 1)), int(n * (1 - 2.0 ** -res))
  masked[start_x:start_x + len_x, :] = 0
  masked[:, start_y:start_y + len_y] = 0
  return masked.reshape(k, m // k, k, n // k).sum(axis=(0, 2))


def filter_bank(m, n, J, L=8):  # pylint: disable=invalid-name
  """The Morlet filter bank in the Fourier domain (real spectra) for an m x n padded grid.

  Args:
    m, n: the padded grid (multiples of 2^J).
    J: the number of scales.
    L: the number of angles.

  Returns:
    (psi, phi): psi[j][res] is an (L, m / 2^res, n / 2^res) float32 array of the wavelets of
    scale j (angles theta_l = (L / 2 - 1 - l) pi / L) on the grid coarsened by 2^res, res <= j;
    phi[res] is the (m / 2^res, n / 2^res) low-pass of scale 2^J, res < J.
  """
  psi = []
  for j in range(J):
    spectra = [np.real(np.fft.fft2(_morlet(m, n, 0.8 * 2 ** j, (int(L - L / 2 - 1) - t) * math.pi / L,
                                           0.75 * math.pi / 2 ** j, 4.0 / L)))
               for t in range(L)]
    psi.append([np.stack([_periodize(s, res) for s in spectra]).astype(np.float32)
                for res in range(j + 1)])
  phi_spectrum = np.real(np.fft.fft2(_gabor(m, n, 0.8 * 2 ** (J - 1), 0.0, 0.0)))
  phi = [_periodize(phi_spectrum, res).astype(np.float32) for res in range(J)]
  return psi, phi


def padded_size(size, J):  # pylint: disable=invalid-name
  """Kymatio's padded size: the next multiple of 2^J above size + 2^J."""
  return ((size + 2 ** J) // 2 ** J + 1) * 2 ** J


def _subsample(x, k):
  """Subsampling by k in space = periodizing the (..., m, n) spectrum over k x k blocks."""
  if k == 1:
    return x
  m, n = x.shape[-2], x.shape[-1]
  shape = tf.concat([tf.shape(x)[:-2], [k, m // k, k, n // k]], axis=0)
  rank = len(x.shape)
  return tf.reduce_mean(tf.reshape(x, shape), axis=[rank - 2, rank])


def _modulus_spectrum(x):
  """The spectrum of |ifft(x)|."""
  return tf.signal.fft2d(tf.cast(tf.abs(tf.signal.ifft2d(x)), tf.complex64))


def _low_pass(x, phi, k):
  """Re(ifft(subsample(x phi, k))) with the one-pixel border of the padding removed."""
  out = tf.math.real(tf.signal.ifft2d(_subsample(x * tf.cast(phi, tf.complex64), k)))
  return out[..., 1:-1, 1:-1]


@keras.saving.register_keras_serializable(package="tf_dpiter")
class Scattering2D(keras.layers.Layer):
  """The 2D scattering transform (order 2) of images, channels last, without weights.

  Input (batch, H, W) or (batch, H, W, C), H and W >= 2^J; output
  (batch, H', W', C K) channels last with H' = padded_size(H, J) / 2^J - 2 (H / 2^J when
  2^J divides H) and K = 1 + J L + L^2 J (J - 1) / 2 coefficients per input channel, in
  Kymatio's order (S0; S1 by (j1, theta1); S2 by (j1, theta1, j2, theta2)). For 28 x 28
  MNIST with J = 2, L = 8: (batch, 7, 7, 81). Data-independent: it costs no privacy.

  Args:
    J: the number of scales (int >= 1); the output is subsampled by 2^J.
    L: the number of angles (int >= 1).
    max_order: 1 or 2.

  Raises:
    ParameterValueError: J, L or max_order out of range, or an image smaller than 2^J.
  """

  def __init__(self, J=2, L=8, max_order=2, **kwargs):  # pylint: disable=invalid-name
    super().__init__(trainable=False, **kwargs)
    if not isinstance(J, int) or J < 1:
      raise ParameterValueError(f"`J` must be an integer >= 1. Received: J={J!r}")
    if not isinstance(L, int) or L < 1:
      raise ParameterValueError(f"`L` must be an integer >= 1. Received: L={L!r}")
    if max_order not in (1, 2):
      raise ParameterValueError(f"`max_order` must be 1 or 2. Received: max_order={max_order!r}")
    self.J, self.L, self.max_order = J, L, max_order  # pylint: disable=invalid-name
    self._banks = {}

  @property
  def num_coefficients(self):
    """K, the number of scattering channels per input channel."""
    second = self.L * self.L * self.J * (self.J - 1) // 2 if self.max_order == 2 else 0
    return 1 + self.J * self.L + second

  def _bank(self, h, w):
    if min(h, w) < 2 ** self.J:
      raise ParameterValueError(f"Scattering2D with J={self.J} needs images of at least "
                                f"{2 ** self.J} x {2 ** self.J} pixels. Received: {h} x {w}")
    if (h, w) not in self._banks:
      self._banks[(h, w)] = filter_bank(padded_size(h, self.J), padded_size(w, self.J),
                                        self.J, self.L)
    return self._banks[(h, w)]

  def _scatter(self, x, psi, phi):
    """Scattering of x (batch, m, n) float32 padded -> list of (batch, k, h', w')."""
    J = self.J  # pylint: disable=invalid-name
    u0 = tf.signal.fft2d(tf.cast(x, tf.complex64))
    out = [_low_pass(u0, phi[0], 2 ** J)[:, None]]
    second = []
    for j1 in range(J):
      u1 = u0[:, None] * tf.cast(psi[j1][0], tf.complex64)
      u1 = _modulus_spectrum(_subsample(u1, 2 ** j1))              # (batch, L, m1, n1)
      out.append(_low_pass(u1, phi[j1], 2 ** (J - j1)))
      if self.max_order < 2:
        continue
      per_j2 = []
      for j2 in range(j1 + 1, J):
        u2 = u1[:, :, None] * tf.cast(psi[j2][j1], tf.complex64)   # (batch, L, L, m1, n1)
        u2 = _modulus_spectrum(_subsample(u2, 2 ** (j2 - j1)))
        per_j2.append(_low_pass(u2, phi[j2], 2 ** (J - j2)))
      if per_j2:
        s2 = tf.concat(per_j2, axis=2)                               # (batch, L1, (j2, L2), .)
        second.append(tf.reshape(s2, [-1, s2.shape[1] * s2.shape[2]] + list(s2.shape[3:])))
    return out + second

  def call(self, inputs):
    x = tf.cast(inputs, tf.float32)   # no op on float32
    squeeze = len(x.shape) == 3
    if squeeze:
      x = x[..., None]
    if len(x.shape) != 4:
      raise ParameterValueError("Scattering2D expects (batch, H, W) or (batch, H, W, C) inputs. "
                                f"Received: shape={x.shape}")
    h, w, c = x.shape[1], x.shape[2], x.shape[3]
    psi, phi = self._bank(h, w)
    pad_h, pad_w = padded_size(h, self.J) - h, padded_size(w, self.J) - w
    x = tf.reshape(tf.transpose(x, [0, 3, 1, 2]), [-1, h, w])       # (batch C, h, w)
    x = tf.pad(x, [[0, 0], [pad_h // 2, (pad_h + 1) // 2], [pad_w // 2, (pad_w + 1) // 2]],
               mode="REFLECT")
    s = tf.concat(self._scatter(x, psi, phi), axis=1)                # (batch C, K, h', w')
    s = tf.reshape(s, [-1, c * s.shape[1], s.shape[2], s.shape[3]])
    return tf.transpose(s, [0, 2, 3, 1])

  def compute_output_shape(self, input_shape):
    h, w = input_shape[1], input_shape[2]
    c = 1 if len(input_shape) == 3 else input_shape[3]
    size = lambda d: padded_size(d, self.J) // 2 ** self.J - 2  # noqa: E731
    return (input_shape[0], size(h), size(w), c * self.num_coefficients)

  def get_config(self):
    config = super().get_config()
    config.update({"J": self.J, "L": self.L, "max_order": self.max_order})
    config.pop("trainable", None)
    return config
