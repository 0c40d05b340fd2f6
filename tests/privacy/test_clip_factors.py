"""The per-record clip factors (dp_query.clip_factors) against the query's own preprocess_record."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter import dp_query


class _ClipsHalf(dp_query.GaussianSumQuery):
  """Changes the clipping but not the factors: a factor-based path must refuse it."""

  def preprocess_record(self, params, record):
    return super().preprocess_record(params * 0.5, record)


@pytest.mark.parametrize("clip", [0.3, 1.0, 7.0])
def test_factors_reproduce_preprocess_record(clip):
  query = dp_query.GaussianSumQuery(clip, 0.0)
  params = query.derive_sample_params(query.initial_global_state())
  rng = np.random.default_rng(0)
  records = [tf.constant(rng.normal(size=(2, 3)) * s, tf.float32) for s in (0.0, 0.1, 1.0, 10.0)]
  norms = tf.stack([dp_query.global_l2_norm(r) for r in records])
  factors = query.record_clip_factors(params, norms)
  for record, factor in zip(records, factors):
    np.testing.assert_allclose(record * factor, query.preprocess_record(params, record),
                               rtol=1e-6)


def test_non_finite_norm_gets_factor_zero():
  factors = dp_query.clip_factors(tf.constant([0.0, 2.0, np.inf, np.nan]), 1.0)
  np.testing.assert_array_equal(factors, [1.0, 0.5, 0.0, 0.0])


@pytest.mark.parametrize("make,gives", [
    (lambda: dp_query.GaussianSumQuery(1.0, 0.0), True),
    (lambda: _ClipsHalf(1.0, 0.0), False),
    (lambda: dp_query.NestedQuery([dp_query.GaussianSumQuery(1.0, 0.0)]), False),
    (lambda: dp_query.QuantileAdaptiveClipSumQuery(0.1, 0.5, 0.5, 0.5, 2.0, 32), False),
], ids=["gaussian", "subclass_changes_clip", "nested", "adaptive"])
def test_gives_clip_factors(make, gives):
  query = make()
  assert dp_query.gives_clip_factors(query) is gives
  if not gives and type(query).record_clip_factors is dp_query.DPQuery.record_clip_factors:
    with pytest.raises(NotImplementedError, match="record_clip_factors"):
      query.record_clip_factors((), tf.constant([1.0]))
