"""Review of the convolution's folded patch Gram norm bound in float32 alone
(conv._fold_gram_sqr_norm, conv._fold_gram_contraction): the value returned must bound the
exact squared norm of the record's kernel gradient sum_t p_t dz_t^T of the float32 inputs,
computed here independently in float64 (the filter gradient of a float64 convolution, no
Gram), on adversarial records:
  cancellation: every patch equal (one pixel vector a, |a| 1e4 .. 1e6, VALID padding) and
    output gradients v and -v (1 + 2^-23) at two positions (the exact gradient ~2^-23 of its
    parts), or + and - alternating over all positions;
  mixed magnitudes: each pixel and each output position scaled by 10^U(-3, 6) / 10^U(-3, 3);
  float16-overflow-adjacent values: inputs and output gradients of magnitude ~6.5e4;
and ordinary records (normal entries), where it must not be looser than 1e-3 relative.
Padding SAME and VALID, strides 1 and 2 (the fold needs each stride to divide its kernel
size), kernels 2 .. 4, records of 1, 2 and 3 examples, graph and XLA.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping import algebra
from tf_dpiter.keras.fast_clipping.rules import conv
from tf_dpiter.keras.fast_clipping.rules import conv_unfold

from .covers import assert_covers
from .covers import cover
from .covers import slow_outside

# (spatial, cin, cout, kernel, stride, padding)
GEOMETRIES = [(6, 3, 4, 3, 1, "valid"), (6, 3, 4, 3, 1, "same"), (8, 2, 5, 4, 2, "valid"),
              (8, 2, 5, 4, 2, "same"), (7, 4, 3, 2, 2, "valid"), (9, 2, 3, 2, 1, "same")]


def _out_hw(spatial, ksize, stride, padding):
  if padding == "same":
    return -(-spatial // stride)
  return (spatial - ksize) // stride + 1


def exact_sqr_norms(x, dz, ksize, stride, padding, k):
  """||sum over a record's examples of sum_t p_t dz_t^T||^2 in float64 (numpy in, the filter
  gradient of a float64 convolution)."""
  x64 = tf.constant(x, tf.float64)
  w = tf.zeros([ksize, ksize, x.shape[-1], dz.shape[-1]], tf.float64)
  out = []
  for i in range(0, x.shape[0], k):
    with tf.GradientTape() as tape:
      tape.watch(w)
      z = tf.nn.conv2d(x64[i:i + k], w, stride, padding.upper())
    g = tape.gradient(z, w, output_gradients=tf.constant(dz[i:i + k], tf.float64))
    out.append(float(tf.reduce_sum(tf.square(g))))
  return np.array(out)


def returned_sqr_norms(x, dz, ksize, stride, padding, k, jit, sum_rows=None):
  def fn(x, dz):
    with algebra.examples_per_record(k):
      return conv._fold_gram_sqr_norm(x, dz, (ksize, ksize), (stride, stride), padding,
                                      sum_rows)
  return tf.function(fn, jit_compile=jit)(tf.constant(x), tf.constant(dz)).numpy().astype(
      np.float64)


def _records(kind, geometry, count, seed):
  spatial, cin, cout, ksize, stride, padding = geometry
  ho = _out_hw(spatial, ksize, stride, padding)
  rng = np.random.RandomState(seed)
  x = rng.normal(size=(count, spatial, spatial, cin))
  dz = rng.normal(size=(count, ho, ho, cout))
  if kind == "cancel_pair":
    for i in range(count):
      x[i] = rng.normal(size=cin) * 10.0 ** rng.uniform(4, 6)
      v = rng.normal(size=cout) * 10.0 ** rng.uniform(-2, 2)
      dz[i] = 0.0
      dz[i, 0, 0] = v
      dz[i, 0, 1] = -np.nextafter(v.astype(np.float32), 2 * v.astype(np.float32))
  elif kind == "cancel_alternating":
    for i in range(count):
      x[i] = rng.normal(size=cin) * 10.0 ** rng.uniform(4, 6)
      v = rng.normal(size=cout)
      signs = (-1.0) ** np.arange(ho * ho).reshape(ho, ho, 1)
      dz[i] = signs * v * (1 + 2.0 ** -23 * rng.randint(0, 3, (ho, ho, 1)))
  elif kind == "mixed":
    x *= 10.0 ** rng.uniform(-3, 6, (count, spatial, spatial, 1))
    dz *= 10.0 ** rng.uniform(-3, 3, (count, ho, ho, 1))
  elif kind == "f16_edge":
    x = np.sign(x) * 6.5e4 * rng.uniform(0.99, 1.0, x.shape)
    dz = np.sign(dz) * 6.5e4 * rng.uniform(0.99, 1.0, dz.shape)
  return x.astype(np.float32), dz.astype(np.float32)


def _foldable(geometry):
  spatial, cin, _, ksize, stride, padding = geometry
  ho = _out_hw(spatial, ksize, stride, padding)
  x = tf.zeros([1, spatial, spatial, cin])
  return conv_unfold.foldable(x, (ksize, ksize), (stride, stride), (1, 1), (ho, ho))


def test_geometries_fold():
  assert all(_foldable(g) for g in GEOMETRIES)


# (geometry, kind, k, jit): the cancelling kinds on VALID geometries only (SAME padding makes
# the border patches differ: no exact cancellation), the others on every geometry; records of
# 1, 2, 3 examples, graph and XLA. By default each geometry once, each kind in graph and under
# XLA, each record size once; the rest (the all-pairs cover among them) with -m slow.
ADVERSARIAL = [(g, kind, k, jit) for g in GEOMETRIES
               for kind in ["cancel_pair", "cancel_alternating", "mixed", "f16_edge"]
               if not (kind.startswith("cancel") and g[-1] == "same")
               for k in (1, 2, 3) for jit in (False, True)]
ADVERSARIAL_GROUPS = [(0,), (1, 3), (2,)]
ADVERSARIAL_DEFAULT = cover(ADVERSARIAL, ADVERSARIAL_GROUPS)
# (geometry, k, jit) on ordinary records: by default each geometry once, each record size in
# both modes, holding the loosest case (the last geometry at k = 3: _tight_cases) in both modes
TIGHT = [(g, k, jit) for g in GEOMETRIES for k in (1, 2, 3) for jit in (False, True)]
TIGHT_GROUPS = [(0,), (1, 2)]
TIGHT_DEFAULT = cover(TIGHT, TIGHT_GROUPS,
                      first=[(GEOMETRIES[-1], 3, False), (GEOMETRIES[-1], 3, True)])


def test_default_cases_cover_every_geometry_kind_and_mode():
  assert_covers(ADVERSARIAL_DEFAULT, ADVERSARIAL, ADVERSARIAL_GROUPS)
  assert_covers(TIGHT_DEFAULT, TIGHT, TIGHT_GROUPS)
  assert len(ADVERSARIAL_DEFAULT) < len(ADVERSARIAL) / 6 and len(TIGHT_DEFAULT) < len(TIGHT) / 3


def _id(case):
  return "-".join("x".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in case)


@pytest.mark.parametrize("geometry,kind,k,jit", slow_outside(ADVERSARIAL, ADVERSARIAL_DEFAULT,
                                                             ids=_id))
def test_bound_holds_on_adversarial_records(geometry, kind, k, jit):
  _, _, _, ksize, stride, padding = geometry
  x, dz = _records(kind, geometry, 6 * k, seed=k)
  exact = exact_sqr_norms(x, dz, ksize, stride, padding, k)
  got = returned_sqr_norms(x, dz, ksize, stride, padding, k, jit)
  # a float32 result's own rounding: 2^-23 relative
  assert np.all(got >= exact * (1 - 2.0 ** -22)), np.min(got / np.maximum(exact, 1e-300))


def _tight_cases():
  """TIGHT's cases, slow outside TIGHT_DEFAULT. The last geometry at k = 3 (T' = 3 x 81
  positions, K = 8, N = 3) was 1.87e-3 above the exact norm while the contraction's own
  rounding was bounded by gamma_{2T'} ||ga||_F ||gb||_F (growing like T'^2 u / sqrt(K N) on
  ordinary records); with the sum of |products| formed and the rows added by a pinned tree
  (conv._fold_gram_contraction, gamma_{T' + ceil(log2 T')}) 5.8e-4 (measured 2026-11-30)."""
  return slow_outside(TIGHT, TIGHT_DEFAULT, ids=_id)


@pytest.mark.parametrize("geometry,k,jit", list(_tight_cases()))
def test_bound_is_tight_on_ordinary_records(geometry, k, jit):
  """Normal entries: within 1e-3 relative of the exact norm (not squared) without sum_rows."""
  _, _, _, ksize, stride, padding = geometry
  x, dz = _records("ordinary", geometry, 6 * k, seed=10 + k)
  exact = np.sqrt(exact_sqr_norms(x, dz, ksize, stride, padding, k))
  got = np.sqrt(returned_sqr_norms(x, dz, ksize, stride, padding, k, jit))
  rel = got / exact - 1
  assert np.all(rel >= -2.0 ** -23) and np.all(rel <= 1e-3), (rel.min(), rel.max())


def test_xla_keeps_the_contraction_rows_a_dot():
  """_fold_gram_contraction's bound takes T' + ceil(log2 T') roundings per product (T' row
  sums, then the rows by a pinned tree): under XLA the rows are a dot, kept apart from the
  tree's additions (a compiler that merged them into one reduction of the T'^2 products
  would give gamma_{T'^2}). The compiled function's optimized HLO must hold
  a dot of the Grams to [R, T'] (TF 2.21 does); a compiler that fuses it fails here."""
  rng = np.random.RandomState(0)
  a = tf.constant(rng.normal(size=(4, 30, 7)), tf.float32)
  b = tf.constant(rng.normal(size=(4, 30, 5)), tf.float32)
  ga, gb = tf.matmul(a, a, transpose_b=True), tf.matmul(b, b, transpose_b=True)

  def fn(ga, gb):
    na, nb = tf.sqrt(tf.linalg.diag_part(ga)), tf.sqrt(tf.linalg.diag_part(gb))
    return conv._fold_gram_contraction(ga, gb, na, nb, 20, 8)

  hlo = tf.function(fn, jit_compile=True).experimental_get_compiler_ir(ga, gb)(
      stage="optimized_hlo")
  assert any("f32[4,30]" in line and " dot(" in line for line in hlo.splitlines()), hlo
