"""dp.data.map_records takes the function as users write it: fn(x, y) (the weights / Poisson
mask pass through), fn(x) (inputs only), or fn(x, y, weight) (every component)."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.dp_query import NotPrivateSeedWarning


def _poisson():
  x = np.arange(80, dtype="float32").reshape(40, 2)
  y = np.arange(40) % 3
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NotPrivateSeedWarning)
    return dp.data.poisson_batches(x, y, expected_batch_size=8, seed=5)


def _batches(ds):
  return list(ds.take(3).as_numpy_iterator())


@pytest.mark.parametrize("fn,expect", [
    (lambda x, y: (x * 2.0, y + 10), lambda x, y, w: (x * 2.0, y + 10, w)),
    (lambda x: x - 1.0, lambda x, y, w: (x - 1.0, y, w)),
    (lambda x, y, w: (x, y, w * 3.0), lambda x, y, w: (x, y, w * 3.0)),
    (lambda *c: c, lambda x, y, w: (x, y, w)),
])
def test_fn_gets_the_leading_components_and_the_rest_pass_through(fn, expect):
  plain, mapped = _poisson(), dp.data.map_records(_poisson(), fn)
  assert dp.data.get_sampling_spec(mapped).policy == "poisson"
  for before, after in zip(_batches(plain), _batches(mapped)):
    assert len(after) == 3
    for got, want in zip(after, expect(*before)):
      np.testing.assert_array_equal(got, want)


def test_fn_with_too_many_arguments_is_refused_naming_it():
  def four(x, y, w, extra):
    return x, y, w, extra

  with pytest.raises(ValueError, match=r"fn='four' requires 4 positional arguments.*3 "
                                       r"components"):
    dp.data.map_records(_poisson(), four)


def test_records_stay_unmixed_with_fn_of_x_and_y():
  ds = dp.data.map_records(_poisson(), lambda x, y: (x - tf.reduce_mean(x), y))
  for bx, _, mask in _batches(ds):   # each real record is its own two values, centred
    real = bx[mask > 0]
    assert len(real) > 0
    np.testing.assert_allclose(real, np.array([[-0.5, 0.5]] * len(real)))
