"""Sampling declarations through tf.data: kept by per-record maps and transforms that leave
each step's batch the drawn sample; refused, naming the transform, otherwise."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.dp_query import NotPrivateSeedWarning


@pytest.fixture(autouse=True)
def _quiet_seed_warnings():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NotPrivateSeedWarning)
    yield


def _xy(n=40):
  return np.arange(n * 2, dtype="float32").reshape(n, 2), np.arange(n) % 3


def _poisson(**kw):
  x, y = _xy()
  return dp.data.poisson_batches(x, y, expected_batch_size=8, seed=1, **kw)


def _shuffled(**kw):
  x, y = _xy()
  return dp.data.shuffled_batches(x, y, batch_size=8, seed=1, **kw)


@pytest.mark.parametrize("make", [_poisson, _shuffled])
@pytest.mark.parametrize("transform", [
    lambda ds: ds.prefetch(1),
    lambda ds: ds.with_options(tf.data.Options()),
    lambda ds: ds.repeat(2).take(3),
    lambda ds: ds.apply(tf.data.experimental.assert_cardinality(5)),
])
def test_transforms_that_keep_the_batches_keep_the_declaration(make, transform):
  ds = make()
  assert dp.data.get_sampling_spec(transform(ds)) is dp.data.get_sampling_spec(ds)


@pytest.mark.parametrize("make", [_poisson, _shuffled])
@pytest.mark.parametrize("name,transform,why", [
    ("map", lambda ds: ds.map(lambda *e: e), "may mix records"),
    ("map", lambda ds: ds.map(lambda *e: e, num_parallel_calls=2), "map_records"),
    ("cache", lambda ds: ds.prefetch(1).cache(), "replays the first pass"),
    ("batch", lambda ds: ds.batch(2), "which records form each step's batch"),
    ("unbatch", lambda ds: ds.unbatch(), "which records form each step's batch"),
    ("filter", lambda ds: ds.filter(lambda *e: True), "which records form"),
    ("shuffle", lambda ds: ds.shuffle(4).prefetch(1), "which records form"),
])
def test_transforms_that_lose_the_declaration_are_named(make, name, transform, why):
  with pytest.raises(ValueError, match=rf"declaration was lost at \.{name}\(\): .*{why}"):
    dp.data.get_sampling_spec(transform(make()))


def test_plain_datasets_still_declare_nothing():
  assert dp.data.get_sampling_spec(tf.data.Dataset.range(4).map(lambda v: v)) is None


def test_poisson_map_fn_is_applied_to_each_record_and_leaves_the_mask():
  x, y = _xy()
  plain = dp.data.poisson_batches(x, y, expected_batch_size=8, seed=5)
  mapped = dp.data.poisson_batches(x, y, expected_batch_size=8, seed=5,
                                   map_fn=lambda a, b: (a * 2.0 + 1.0, b + 10))
  assert dp.data.get_sampling_spec(mapped) == dp.data.get_sampling_spec(plain)
  for (px, py, pm), (mx, my, mm) in zip(plain.as_numpy_iterator(), mapped.as_numpy_iterator()):
    np.testing.assert_array_equal(mx, px * 2.0 + 1.0)
    np.testing.assert_array_equal(my, py + 10)
    np.testing.assert_array_equal(mm, pm)


def test_map_records_cannot_mix_records():
  """A function written as if over a batch (x - mean(x)) sees one record: the result of each
  record is the record's own, whatever the others."""
  ds = dp.data.map_records(_poisson(max_batch_size=None),
                           lambda x, y, w: (x - tf.reduce_mean(x), y, w))
  for bx, _, _ in ds.take(3).as_numpy_iterator():
    np.testing.assert_allclose(bx, np.array([[-0.5, 0.5]] * bx.shape[0]).reshape(bx.shape))
  assert dp.data.get_sampling_spec(ds).policy == "poisson"
  with pytest.raises(ValueError, match="map_records needs a dataset from dp.data"):
    dp.data.map_records(tf.data.Dataset.range(3), lambda v: v)


def test_shuffled_map_fn_keeps_weights_and_counts_passes():
  x, y = _xy()
  w = np.linspace(0.5, 1.0, 40).astype("float32")
  ds = dp.data.shuffled_batches(x, y, batch_size=10, seed=2, sample_weight=w,
                                map_fn=lambda a, b: (a[:1], b))
  spec = dp.data.get_sampling_spec(ds)
  batches = list(ds.as_numpy_iterator())
  assert len(batches) == 4 and spec.sampler.take_new_passes() == 1
  got_x = np.concatenate([b[0] for b in batches])
  got_w = np.concatenate([b[2] for b in batches])
  assert got_x.shape == (40, 1)
  order = np.argsort(got_x[:, 0])
  np.testing.assert_array_equal(got_x[order, 0], x[:, 0])
  np.testing.assert_array_equal(got_w[order], w)


def test_fit_names_the_transform_and_trains_through_kept_ones():
  x, y = _xy()
  model = dp.keras.DPSequential([keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  ds = dp.data.poisson_batches(x, y, expected_batch_size=8, seed=1, map_fn=lambda a, b: (a / 80, b))
  with pytest.raises(ValueError, match=r"lost at \.map\(\)"):
    model.fit(ds.map(lambda a, b, m: (a, b, m)), epochs=1, verbose=0)
  model.fit(ds.prefetch(1).with_options(tf.data.Options()), epochs=1, verbose=0)
  assert int(model.ledger.sample_count.numpy()) == 5
  cfg = model.optimizer.dp_query.get_config()
  assert (cfg["policy"], cfg["selection_probability"]) == ("poisson", pytest.approx(8 / 40))
