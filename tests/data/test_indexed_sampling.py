"""Out-of-core Poisson sampling by index (tf_dpiter.data.indexed_records / indexed_sampling):
TFRecord shards with an offset index written at test time, the selection law checked exactly,
and fit on the sampled dataset recording the ledger of `poisson_batches`; the in-graph sampler
(tf_dpiter.data.graph_sampling) against the same statistics."""

import itertools
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data import graph_sampling
from tf_dpiter.data import indexed_records
from tf_dpiter.data import indexed_sampling

# Nightly (`-m slow`): the law of 2 parts. test_selection_law_is_independent_bernoulli_
# exactly[3] stays by default: the same union of the parts' poisson_indices against every
# subset's Poisson probability (chi-square), over part_range boundaries with a middle part
# too; [1] keeps the single draw.
SLOW_CASES = {"test_selection_law_is_independent_bernoulli_exactly[2]"}
from tf_dpiter.dp_query import NotPrivateSeedWarning


def _chunks(x, y, size):
  for i in range(0, len(x), size):
    yield x[i:i + size], (None if y is None else y[i:i + size])


@pytest.fixture(name="data")
def _data():
  rng = np.random.RandomState(0)
  n = 600
  return rng.randn(n, 5, 2).astype("float32"), rng.randint(0, 3, n).astype("int32")


def _sampled(source, **kw):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NotPrivateSeedWarning)
    return indexed_sampling.poisson_batches_from_source(source, **kw)


@pytest.mark.parametrize("labels", [True, False])
def test_shards_round_trip_by_index_and_sequentially(tmp_path, data, labels):
  x, y = data[0], (data[1] if labels else None)
  path = indexed_records.write_indexed_tfrecords(str(tmp_path / "ds"), _chunks(x, y, 250),
                                                 records_per_shard=128)
  src = indexed_records.TFRecordSource(path)
  assert src.num_records == len(x) and src.has_labels == labels
  assert len(src.shard_paths) == 5                       # ceil(600 / 128)
  idx = np.array([0, 1, 127, 128, 300, 599])
  bx, by = src.read(idx)
  np.testing.assert_array_equal(bx, x[idx])
  if labels:
    np.testing.assert_array_equal(by, y[idx])
  else:
    assert by is None
  # plain TFRecord: read sequentially by tf.data, decoded as raw bytes
  raw = [r.numpy() for r in tf.data.TFRecordDataset(src.shard_paths)]
  rec = np.frombuffer(b"".join(raw), src.dtype)
  np.testing.assert_array_equal(rec["x"], x)


def test_truncated_shard_and_bad_arguments_are_refused(tmp_path, data):
  x, y = data
  path = indexed_records.write_indexed_tfrecords(str(tmp_path / "ds"), [(x, y)],
                                                 records_per_shard=1000)
  with pytest.raises(ValueError, match="already holds"):
    indexed_records.write_indexed_tfrecords(path, [(x, y)])
  src = indexed_records.TFRecordSource(path)
  with pytest.raises(ValueError, match="record indices"):
    src.read(np.array([600]))
  with open(src.shard_paths[0], "r+b") as f:
    f.truncate(100)
  with pytest.raises(ValueError, match="truncated"):
    indexed_records.TFRecordSource(path)
  for kw, match in [(dict(expected_batch_size=0), "expected_batch_size"),
                    (dict(steps_per_epoch=0), "steps_per_epoch"),
                    (dict(max_batch_size=0), "max_batch_size"),
                    (dict(num_parts=2, parts=(2,)), "part_index")]:
    with pytest.raises(ValueError, match=match):
      _sampled(indexed_records.ArraySource(x, y), **{"expected_batch_size": 10, **kw})


def _chi2_subsets(draw, n, q, trials):
  """Chi-square statistic of the observed subsets of {0..n-1} against q^|S| (1-q)^(n-|S|)."""
  counts = {}
  for _ in range(trials):
    s = draw()
    counts[s] = counts.get(s, 0) + 1
  stat = 0.0
  for bits in itertools.product((0, 1), repeat=n):
    s = tuple(i for i in range(n) if bits[i])
    expected = trials * q ** len(s) * (1 - q) ** (n - len(s))
    stat += (counts.pop(s, 0) - expected) ** 2 / expected
  assert not counts            # no subset outside {0..n-1}, no repeated index
  return stat


@pytest.mark.parametrize("num_parts", [1, 2, 3])
def test_selection_law_is_independent_bernoulli_exactly(num_parts):
  # Every one of the 2^5 subsets of 5 records, against its Poisson probability; with parts,
  # the union of the parts' samples of one step. 31 degrees of freedom: the 0.999 quantile of
  # chi-square(31) is 61.1 (the test fails by chance once in a thousand seeds).
  n, q, trials = 5, 0.3, 20000
  rng = np.random.Generator(np.random.Philox(7 + num_parts))
  ranges = [indexed_sampling.part_range(n, num_parts, p) for p in range(num_parts)]
  assert ranges[0][0] == 0 and ranges[-1][1] == n and all(
      a[1] == b[0] for a, b in zip(ranges, ranges[1:]))

  def draw():
    parts = [indexed_sampling.poisson_indices(rng, lo, hi, q) for lo, hi in ranges]
    return tuple(int(i) for i in np.concatenate(parts))

  assert _chi2_subsets(draw, n, q, trials) < 61.1


def test_poisson_batches_law_is_independent_bernoulli_exactly():
  # The dataset of dp.data.poisson_batches end to end (Binomial size + uniform subset drawn
  # in Python, rows gathered by TF): all 2^5 subsets against q^|S| (1-q)^(n-|S|). 4000 draws:
  # the rarest subset is expected 4000 * 0.3^5 = 9.7 times (>= 5 for the chi-square
  # approximation); the 0.999 quantile of chi-square(31) is 61.1.
  n, q, trials = 5, 0.3, 4000
  ids = np.arange(n, dtype="int32")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NotPrivateSeedWarning)
    ds = dp.data.poisson_batches(ids[:, None].astype("float32"), ids, q * n,
                                 steps_per_epoch=trials, max_batch_size=None, seed=11)
  it = ds.as_numpy_iterator()

  def draw():
    bx, by, w = next(it)
    m = int(w.sum())
    assert np.all(w[:m] == 1) and np.all(w[m:] == 0) and np.all(bx[m:] == 0)
    assert bx.shape[0] == max(m, 1)          # unpadded; an empty sample: one row of weight 0
    np.testing.assert_array_equal(bx[:m, 0], by[:m])
    return tuple(int(i) for i in by[:m])

  assert _chi2_subsets(draw, n, q, trials) < 61.1


@pytest.mark.parametrize("sampler", ["tfrecord_by_index", "in_graph"])
def test_dataset_inclusion_counts_sizes_and_padding(tmp_path, data, sampler):
  x, y = data
  n, eb, steps = len(x), 30, 400
  ids = np.arange(n, dtype="int32")
  if sampler == "in_graph":
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", NotPrivateSeedWarning)
      ds = graph_sampling.poisson_batches_in_graph(ids[:, None].astype("float32"), ids, eb,
                                                   steps_per_epoch=steps, seed=3)
  else:
    src = indexed_records.TFRecordSource(indexed_records.write_indexed_tfrecords(
        str(tmp_path / "ds"), _chunks(ids[:, None].astype("float32"), ids, 200),
        records_per_shard=256))
    ds = _sampled(src, expected_batch_size=eb, steps_per_epoch=steps, seed=3)
  spec = dp.data.get_sampling_spec(ds)
  q = eb / n
  assert (spec.policy, spec.population_size, spec.sample_size) == ("poisson", n, eb)
  assert spec.selection_probability == pytest.approx(q)
  size = dp.data.default_max_batch_size(n, q)
  seen, sizes = np.zeros(n), []
  for bx, by, mask in ds.as_numpy_iterator():
    m = int(mask.sum())
    assert bx.shape == (size, 1) and np.all(mask[:m] == 1) and np.all(mask[m:] == 0)
    np.testing.assert_array_equal(bx[:m, 0], by[:m])
    assert np.all(bx[m:] == 0) and len(set(by[:m])) == m
    seen[by[:m]] += 1
    sizes.append(m)
  sizes = np.asarray(sizes, float)
  # |R| ~ Binomial(n, q): 400 steps, the mean's standard error sqrt(eb (1-q) / 400); 5 se.
  assert abs(sizes.mean() - eb) < 5 * np.sqrt(eb * (1 - q) / steps)
  # per-record counts ~ Binomial(steps, q), independent: mean of n counts within 5 se, and
  # their variance within 5 relative se (sqrt(2 / (n - 1)) = 5.8%) of steps q (1 - q).
  assert abs(seen.mean() - steps * q) < 5 * np.sqrt(steps * q * (1 - q) / n)
  assert abs(seen.var(ddof=1) / (steps * q * (1 - q)) - 1) < 5 * np.sqrt(2 / (n - 1))


def test_parts_are_disjoint_shares_of_one_global_sample(data):
  x, y = data
  n = len(x)
  src = indexed_records.ArraySource(np.arange(n)[:, None], np.arange(n))
  ds = _sampled(src, expected_batch_size=60, steps_per_epoch=50, seed=5, parts=(0, 1, 2),
                num_parts=3)
  spec = dp.data.get_sampling_spec(ds)
  assert (spec.population_size, spec.selection_probability) == (n, pytest.approx(0.1))
  batches = list(ds.as_numpy_iterator())
  assert len(batches) == 150                     # one element per part per step
  for p, (_, by, mask) in enumerate(batches[:3]):
    lo, hi = indexed_sampling.part_range(n, 3, p)
    got = by[mask > 0]
    assert np.all((got >= lo) & (got < hi))


def test_fit_records_the_poisson_ledger_and_dp_accounting_epsilon(tmp_path, data):
  x, y = data
  n, eb, steps, z = len(x), 40, 6, 1.25   # z exact in float32 (the noise stddev is float32)
  src = indexed_records.TFRecordSource(indexed_records.write_indexed_tfrecords(
      str(tmp_path / "ds"), _chunks(x.reshape(n, -1), y, 300)))
  ds = _sampled(src, expected_batch_size=eb, steps_per_epoch=steps, seed=1)
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((10,)), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, z, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(ds, epochs=2, verbose=0)
  (run,) = model.ledger.to_dict()["runs"]
  assert run["count"] == 2 * steps
  assert (run["policy"], run["population_size"]) == ("poisson", n)
  assert run["selection_probability"] == pytest.approx(eb / n, rel=1e-12)
  acc = dp_accounting.rdp.RdpAccountant()
  acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      eb / n, dp_accounting.GaussianDpEvent(z)), 2 * steps))
  assert dp.accounting.epsilon(model.ledger, 1e-5) == pytest.approx(
      acc.get_epsilon(1e-5), rel=1e-9)
