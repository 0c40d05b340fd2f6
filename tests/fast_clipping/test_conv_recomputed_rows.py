"""The pinned recomputed sum of a convolution (rules/conv.py `_pinned_recomputed_sum`) zeroes
the rows of c = 0 in the output gradients, and in the inputs unless every record's squared
norm is finite, instead of in the gradients it forms again: bit for bit the sum that zeroes
the gradients' rows (its path without `sq`), with rows of c = 0 whose inputs are inf or NaN,
in graph mode (chunks of a batch the trace does not know) and under XLA."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.keras.fast_clipping.rules import conv

# pylint: disable=protected-access

# the tutorial CNN's second convolution: 13x13x16 inputs, 4x4 kernel, stride 2, 32 filters
_X, _DZ = [13, 13, 16], [5, 5, 32]


def _sums(b, jit):
  """The function of (x, dz, c, sq) giving the two sums [4, 4, 16, 32]: zeroing the output
  gradients' rows (with sq), and the gradients' rows (without)."""
  batch = b if jit else None

  @tf.function(jit_compile=jit, input_signature=[
      tf.TensorSpec([batch] + _X), tf.TensorSpec([batch] + _DZ), tf.TensorSpec([batch]),
      tf.TensorSpec([batch])])
  def both(x, dz, c, sq):
    form = conv._per_example_form(None, x, dz, (4, 4), (2, 2), (1, 1), "valid")
    block = conv._pinned_block(form, c)
    return (form.to_kernel(conv._pinned_recomputed_sum(form, x, dz, c, block, sq)),
            form.to_kernel(conv._pinned_recomputed_sum(form, x, dz, c, block)))

  return both


@pytest.mark.parametrize("jit", [False, True])
def test_zeroed_inputs_give_the_sum_of_zeroed_gradients_bit_for_bit(jit):
  b = 200   # several chunks (64 examples each), the last one partial
  sums = _sums(b, jit)
  rng = np.random.RandomState(3)
  x = rng.rand(b, *_X).astype("float32")
  dz = rng.randn(b, *_DZ).astype("float32")
  c = rng.rand(b).astype("float32")
  c[::9] = 0.0
  sq = np.ones(b, "float32")
  for corrupt in (False, True):
    if corrupt:   # records whose norms are not finite get c = 0: the inputs zeroed too
      x[4, 6, 6, 3], c[4], sq[4] = np.inf, 0.0, np.inf
      dz[70, 1, 2, 5], c[70], sq[70] = np.nan, 0.0, np.nan
    new, old = sums(*(tf.constant(v) for v in (x, dz, c, sq)))
    new, old = new.numpy(), old.numpy()
    assert np.isfinite(new).all()
    np.testing.assert_array_equal(new.view(np.int32), old.view(np.int32))
    # and the sum is the float64 sum of the kept records' gradients, to float32 rounding
    keep = c > 0
    patches = np.stack([x[:, 2 * i:2 * i + 4, 2 * j:2 * j + 4, :].reshape(b, -1)
                        for i in range(5) for j in range(5)], 1)
    patches = np.where(keep[:, None, None], patches, 0.0).astype("float64")
    d = np.where(keep[:, None, None], dz.reshape(b, 25, 32), 0.0).astype("float64")
    ref = np.einsum("b,btk,btn->kn", np.where(keep, c, 0.0), patches, d)
    np.testing.assert_allclose(new, ref.reshape(4, 4, 16, 32), rtol=1e-4, atol=1e-3)
