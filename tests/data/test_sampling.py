"""Poisson sampling of batches (McMahan et al. 2018, Section 5)."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.dp_query import NotPrivateSeedWarning


def _ds(**kw):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NotPrivateSeedWarning)
    return dp.data.poisson_batches(**kw)


def test_poisson_sample_sizes_and_static_shape():
  n, eb = 2000, 50
  x = np.arange(n, dtype="float32")[:, None]
  y = np.arange(n)
  ds = _ds(x=x, y=y, expected_batch_size=eb, steps_per_epoch=400, seed=3)
  spec = dp.data.get_sampling_spec(ds)
  assert spec.policy == "poisson" and spec.population_size == n
  assert spec.selection_probability == pytest.approx(eb / n)
  size = dp.data.default_max_batch_size(n, eb / n)
  sizes, seen = [], np.zeros(n)
  for bx, by, mask in ds.as_numpy_iterator():
    assert bx.shape == (size, 1) and mask.shape == (size,)
    m = int(mask.sum())
    sizes.append(m)
    np.testing.assert_array_equal(bx[:m, 0].astype(int), by[:m])   # x and y stay aligned
    assert np.all(mask[:m] == 1) and np.all(mask[m:] == 0) and np.all(bx[m:] == 0)
    assert len(set(by[:m])) == m                                      # no duplicates in a sample
    seen[by[:m]] += 1
  sizes = np.array(sizes, float)
  # |R| ~ Binomial(n, q): mean eb, var eb (1 - q). 400 draws: the mean's standard error is
  # sqrt(eb (1-q) / 400) = 0.35; allow 5 se. The variance estimate: rel. se sqrt(2/399) = 7%; allow 30%.
  assert abs(sizes.mean() - eb) < 5 * np.sqrt(eb * (1 - eb / n) / 400)
  assert abs(sizes.var(ddof=1) / (eb * (1 - eb / n)) - 1) < 0.3
  # every record is selected with the same probability: per-record counts ~ Binomial(400, q)
  assert abs(seen.mean() - 400 * eb / n) < 0.5


def test_never_truncates_a_large_sample():
  x = np.ones([100, 2], "float32")
  ds = _ds(x=x, expected_batch_size=90, max_batch_size=8, steps_per_epoch=3, seed=0)
  for bx, mask in ds.as_numpy_iterator():
    assert bx.shape[0] % 8 == 0 and bx.shape[0] >= mask.sum() > 8


def test_unpadded_and_default_steps():
  x = np.ones([100, 2], "float32")
  ds = _ds(x=x, y=np.zeros(100), expected_batch_size=10, max_batch_size=None, seed=1)
  batches = list(ds.as_numpy_iterator())
  assert len(batches) == 10
  assert all(b[0].shape[0] == b[2].sum() for b in batches)


@pytest.mark.parametrize("sampler, size_arg", [("poisson_batches", "expected_batch_size"),
                                               ("shuffled_batches", "batch_size")])
def test_fixed_seed_warns_and_default_is_nondeterministic(sampler, size_arg):
  make = getattr(dp.data, sampler)
  x = np.arange(1000, dtype="float32")[:, None]
  with pytest.warns(NotPrivateSeedWarning):
    make(x, seed=1, **{size_arg: 10})
  a = next(make(x, **{size_arg: 100}).as_numpy_iterator())
  b = next(make(x, **{size_arg: 100}).as_numpy_iterator())
  assert not all(np.array_equal(u, v) for u, v in zip(tf.nest.flatten(a), tf.nest.flatten(b)))


@pytest.mark.parametrize("kw,match", [
    (dict(expected_batch_size=0), "expected_batch_size"),
    (dict(expected_batch_size=200), "expected_batch_size"),
    (dict(expected_batch_size=10, steps_per_epoch=0), "steps_per_epoch"),
    (dict(expected_batch_size=10, max_batch_size=0), "max_batch_size"),
])
def test_bad_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    dp.data.poisson_batches(np.ones([100, 2]), **kw)


def test_mismatched_lengths():
  with pytest.raises(ValueError, match="same number of records"):
    dp.data.poisson_batches(np.ones([10, 2]), np.ones([9]), expected_batch_size=2)


def test_poisson_sample_weight_multiplies_the_mask():
  x = np.arange(1, 101, dtype="float32")[:, None]    # nonzero: padding rows are 0
  w = (np.arange(100) % 3).astype("float32")          # weights 0, 1, 2 by record
  ds = _ds(x=x, y=np.arange(100), expected_batch_size=30, steps_per_epoch=5, seed=2,
           sample_weight=w)
  for bx, by, weights in ds.as_numpy_iterator():
    m = int(np.count_nonzero(bx[:, 0]))                # sampled rows are at the front
    np.testing.assert_array_equal(weights[:m], w[by[:m]])
    assert np.all(weights[m:] == 0)


def _shuffled(**kw):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NotPrivateSeedWarning)
    return dp.data.shuffled_batches(**kw)


@pytest.mark.parametrize("n,b,drop", [(100, 32, False), (100, 32, True), (64, 64, False)])
def test_shuffled_batches_new_permutation_per_pass_and_passes_counted(n, b, drop):
  x = np.arange(n, dtype="float32")[:, None]
  ds = _shuffled(x=x, y=np.arange(n), batch_size=b, drop_remainder=drop, seed=4)
  spec = dp.data.get_sampling_spec(ds)
  assert (spec.policy, spec.population_size, spec.sample_size) == ("shuffle", n, b)
  assert spec.selection_probability == pytest.approx(b / n)
  orders = []
  for _ in range(3):                                   # every iteration is one new pass
    batches = list(ds.as_numpy_iterator())
    assert len(batches) == dp.data.steps_per_pass(n, b, drop)
    assert all(len(by) == b for _, by in batches[:n // b])
    order = np.concatenate([by for _, by in batches])
    np.testing.assert_array_equal(np.concatenate([bx[:, 0] for bx, _ in batches]), order)
    assert len(set(order)) == len(order) == (n // b * b if drop else n)   # disjoint batches
    orders.append(order)
  assert not np.array_equal(orders[0], orders[1]) or n == b and not np.array_equal(
      orders[1], orders[2])
  assert spec.sampler.passes_started == 3
  assert spec.sampler.take_new_passes() == 3 and spec.sampler.take_new_passes() == 0


def test_shuffled_batches_endless_passes_and_weights():
  n, b = 100, 50
  ds = _shuffled(x=np.zeros([n, 2], "float32"), y=np.arange(n), batch_size=b, passes=None,
                 sample_weight=np.arange(n, dtype="float32"), seed=1)
  got = list(ds.take(7).as_numpy_iterator())
  for _, by, w in got:
    np.testing.assert_array_equal(w, by.astype("float32"))
  sampler = dp.data.get_sampling_spec(ds).sampler
  # 7 batches of 2 per pass: 4 passes used; prefetching may have started one more
  assert 4 <= sampler.passes_started <= 5


@pytest.mark.parametrize("kw,match", [
    (dict(batch_size=0), "batch_size"), (dict(batch_size=101), "batch_size"),
    (dict(batch_size=2.0), "batch_size"), (dict(batch_size=10, passes=0), "passes"),
])
def test_shuffled_batches_bad_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    dp.data.shuffled_batches(np.ones([100, 2]), **kw)


@pytest.mark.parametrize("steps", [1, dp.data.sampling.INDEX_CHUNK + 3])
def test_poisson_samples_in_draw_order_across_index_chunks_and_passes(steps):
  """The generator hands indices to tf.data a chunk of steps at a time: every step is still
  one sequential draw of the sampler (same seed -> the same sequence of samples, over two
  passes), and a pass has exactly `steps` samples whatever the chunk size."""
  n, eb, seed = 500, 20, 7
  x = np.arange(n, dtype=np.int64)
  ds = _ds(x=x, y=None, expected_batch_size=eb, steps_per_epoch=steps, max_batch_size=None,
           seed=seed)
  rng = np.random.Generator(np.random.Philox(seed))
  for _ in range(2):
    got = [xb.numpy()[w.numpy() > 0] for xb, w in ds]
    assert len(got) == steps
    for sample in got:
      want = dp.data.sampling.poisson_indices(rng, 0, n, eb / n)
      np.testing.assert_array_equal(sample, want)


@pytest.mark.parametrize("in_strategy", [False, True])
def test_poisson_rows_match_labels_inside_and_outside_a_strategy_scope(in_strategy):
  """Every yielded row is the record its label names, over two passes, whether the dataset
  is built inside a tf.distribute strategy's scope or not."""
  n = 300
  x = np.arange(n, dtype=np.float32).reshape(n, 1) * 10.0
  y = np.arange(n, dtype=np.int32)
  strategy = (tf.distribute.MirroredStrategy(["/cpu:0"]) if in_strategy
              else tf.distribute.get_strategy())
  with strategy.scope():
    ds = _ds(x=x, y=y, expected_batch_size=30, steps_per_epoch=3, max_batch_size=64, seed=3)
  for _ in range(2):
    for xb, yb, w in ds:
      real = w.numpy() > 0
      assert real.sum() > 0
      np.testing.assert_array_equal(xb.numpy()[real, 0], 10.0 * yb.numpy()[real])
      assert not np.any(xb.numpy()[~real])
