"""The TF PrivacyLedger records correlated-noise steps (issue 16); its file keeps them.

Relation: add or remove one example (cyclic_poisson) or replace one (shuffle, tree rows);
the rows are `records.correlated_query_row`'s, so the ledger holds what the accountant's
rules (accounting.ledger_events) were written for. Epsilon is compared with dp-accounting
called by hand.
"""

import json
import math
import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.data.cyclic_poisson import cyclic_poisson_batches
from tf_dpiter.data.shuffling import shuffled_batches
from tf_dpiter.dp_query import correlated_events as ce
from tf_dpiter.dp_query.band_mf_query import BandMFQuery
from tf_dpiter.dp_query.tree_aggregation_query import TreeAggregationQuery
from tf_dpiter.ledger import ledger_file
from tf_dpiter.ledger import records as rec

DELTA = 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

# (event, policy, sample_size, factor) that its sampling covers.
COVERED = [
    (ce.BandedGaussianEvent(1.5, 2.0, 1.0, 4), rec.CYCLIC_POISSON, 4, 1.0),
    (ce.BandedGaussianEvent(1.5, 2.0, 1.0, 4), rec.CYCLIC_POISSON, 6, 1.0),
    (ce.BandedGaussianEvent(2.0, 3.0, 1.0, 1), rec.POISSON, 0, 1.0),
    (ce.TreeGaussianEvent(1.0, 2.5, 10), rec.SHUFFLE, 10, 2.0),
    (ce.MatrixGaussianEvent(1.0, 3.0, 1.7, 5), rec.CYCLIC_POISSON, 5, 1.0),
]


def _tensor_event(event):
  """The event as a query reports it: clip and stddev float32 tensors."""
  return event._replace(l2_norm_clip=tf.constant(event.l2_norm_clip, tf.float32),
                        stddev=tf.constant(event.stddev, tf.float32))


@pytest.mark.parametrize("in_graph", [False, True])
@pytest.mark.parametrize("event,policy,sample_size,factor", COVERED)
def test_ledger_row_is_the_records_row(event, policy, sample_size, factor, in_graph):
  led = dp.ledger.PrivacyLedger()
  size = tf.Variable(float(sample_size), dtype=tf.float64) if in_graph else sample_size

  def record():
    return led.record_sample(100.0, 0.1, (_tensor_event(event),), policy=policy,
                             sample_size=size)

  (tf.function(record) if in_graph else record)()
  samples, queries = led.get_arrays()
  expected = rec.correlated_query_row(event, policy, sample_size, factor)
  np.testing.assert_allclose(queries[0, 1:], expected, rtol=1e-7)
  assert samples[0, 3] == rec.policy_code(policy) and samples[0, 2] == sample_size


@pytest.mark.parametrize("event,policy", [
    (ce.BandedGaussianEvent(1.0, 1.0, 1.0, 4), rec.POISSON),
    (ce.BandedGaussianEvent(1.0, 1.0, 1.0, 2), rec.SHUFFLE),
    (ce.TreeGaussianEvent(1.0, 1.0, 8), rec.CYCLIC_POISSON),
    (ce.MatrixGaussianEvent(1.0, 1.0, 1.0, 3), rec.TRUNCATED_POISSON),
])
def test_wrong_policy_is_refused_before_anything_is_written(event, policy):
  led = dp.ledger.PrivacyLedger()
  with pytest.raises(ValueError, match=f"only under sampling policy .*got policy '{policy}'"):
    led.record_sample(100.0, 0.1, (event,), policy=policy, sample_size=10)
  assert int(led.sample_count) == 0


def test_cycle_shorter_than_the_bands_is_refused_eagerly_and_in_graph():
  event = ce.BandedGaussianEvent(1.0, 1.0, 1.0, 4)
  led = dp.ledger.PrivacyLedger()
  with pytest.raises(ValueError, match="cycle length >= 4"):
    led.record_sample(100.0, 0.1, (event,), policy=rec.CYCLIC_POISSON, sample_size=3)
  size = tf.Variable(3.0, dtype=tf.float64)
  step = tf.function(lambda: led.record_sample(100.0, 0.1, (_tensor_event(event),),
                                               policy=rec.CYCLIC_POISSON, sample_size=size))
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"sample_size \(cycle length\) >= 4"):
    step()
  assert int(led.sample_count) == 0
  size.assign(4.0)
  step()
  assert int(led.sample_count) == 1


def test_column_norm_rounded_below_one_is_recorded_at_the_clip():
  """A normalized strategy's zeta can be 1 - 1 ulp: the row keeps sensitivity >= clip."""
  led = dp.ledger.PrivacyLedger()
  zeta = 1.0 - 2.0 ** -52
  led.record_sample(100.0, 0.1, (ce.BandedGaussianEvent(1.0, 1.0, zeta, 2),),
                    policy=rec.CYCLIC_POISSON, sample_size=2)
  assert led.get_arrays()[1][0, 4] == 1.0
  assert ledger_file.loads(led.to_json())[1][0, 4] == 1.0


def _mixed_ledger():
  """A cyclic BandMF + BLT ledger and a shuffled tree ledger (one relation each)."""
  cyc = dp.ledger.PrivacyLedger(initial_capacity=2)
  for t in range(7):
    e = ce.BandedGaussianEvent(1.0, 1.2 + 0.1 * (t > 3), 1.0, 3) if t != 5 else \
        ce.MatrixGaussianEvent(1.0, 2.0, 1.3, 3)
    cyc.record_sample(300.0, 0.2, (e,), policy=rec.CYCLIC_POISSON, sample_size=3)
  tree = dp.ledger.PrivacyLedger()
  for _ in range(20):
    tree.record_sample(100.0, 0.1, (ce.TreeGaussianEvent(1.0, 3.0, 10),), policy=rec.SHUFFLE,
                       sample_size=10)
  tree.record_passes(2)
  return cyc, tree


def test_save_load_json_round_trips_correlated_rows(tmp_path):
  for i, led in enumerate(_mixed_ledger()):
    path = str(tmp_path / f"l{i}.json")
    led.save_json(path, key="k")
    loaded = dp.ledger.PrivacyLedger.load_json(path, key="k")
    for a, b in zip(led.get_arrays(), loaded.get_arrays()):
      np.testing.assert_array_equal(a, b)
    assert int(loaded.passes) == int(led.passes)
    assert dp.accounting.epsilon(loaded, DELTA) == dp.accounting.epsilon(led, DELTA)
    kinds = {q["type"] for r in json.load(open(path))["runs"] for q in r["queries"]}
    assert kinds == ({"banded_gaussian", "matrix_gaussian"} if i == 0 else {"tree_gaussian"})


def _tamper_sensitivity(run):
  run["queries"][0]["sensitivity"] *= 0.5


def _tamper_type(run):
  run["queries"][0]["type"] = "gaussian"


def _tamper_policy(run):
  run["policy"] = "poisson"


@pytest.mark.parametrize("tamper", [_tamper_sensitivity, _tamper_type, _tamper_policy])
def test_tampered_correlated_row_is_refused(tamper):
  d = _mixed_ledger()[0].to_dict()
  tamper(d["runs"][0])
  with pytest.raises(ValueError, match="altered"):
    dp.ledger.PrivacyLedger.from_dict(d)
  if tamper is _tamper_type:
    return        # re-signed, a plain Gaussian row under cyclic_poisson is a valid ledger
  with pytest.raises(ValueError, match="sensitivity is below|only under policy cyclic_poisson"):
    dp.ledger.PrivacyLedger.from_dict(ledger_file.sign(d))   # re-signed: the checks refuse it


def test_unknown_query_type_is_refused():
  d = _mixed_ledger()[0].to_dict()
  d["runs"][0]["queries"][0]["type"] = "band"
  with pytest.raises(ValueError, match="query 'type' must be one of"):
    dp.ledger.PrivacyLedger.from_dict(ledger_file.sign(d))


def test_journal_keeps_correlated_rows(tmp_path):
  cyc, _ = _mixed_ledger()
  journal = dp.ledger.LedgerJournal(str(tmp_path / "j.jsonl"))
  journal.append(cyc)
  samples, queries, _ = dp.ledger.LedgerJournal(str(tmp_path / "j.jsonl")).read()
  np.testing.assert_array_equal(samples, cyc.get_arrays()[0])
  np.testing.assert_array_equal(queries, cyc.get_arrays()[1])


def _fit_band_mf(num_bands, num_groups, steps_per_epoch=4, epochs=2, noise=1.1):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(4, activation="relu"),
                                 keras.layers.Dense(3)])
  rng = np.random.RandomState(0)
  x, y = rng.randn(120, 6).astype("float32"), rng.randint(0, 3, 120)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # the test seeds (not private)
    query = BandMFQuery(1.0, noise, template=model.trainable_variables, num_bands=num_bands,
                        num_steps=steps_per_epoch * epochs, seed=3)
    ds = cyclic_poisson_batches(x, y, expected_batch_size=10, num_groups=num_groups,
                                steps_per_epoch=steps_per_epoch, seed=1)
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(dp_query=query, learning_rate=0.1),
                loss=LOSS)
  model.fit(ds, epochs=epochs, verbose=0)
  return model, query


def test_band_mf_fit_on_cyclic_poisson_is_recorded_and_accounted(tmp_path):
  model, query = _fit_band_mf(num_bands=2, num_groups=2)
  led = model.ledger
  d = led.to_dict()
  assert d["num_samples"] == 8 and len(d["runs"]) == 1
  run = d["runs"][0]
  q = 10 * 2 / 120
  assert (run["policy"], run["relation"], run["sample_size"]) == (
      "cyclic_poisson", "add_or_remove_one", 2.0)
  assert run["selection_probability"] == pytest.approx(q, rel=1e-12)
  [row] = run["queries"]
  assert row["type"] == "banded_gaussian" and row["l2_norm_clip"] == 1.0
  assert row["sensitivity"] == pytest.approx(query.column_norm, rel=1e-12)
  # By hand: BandMF with b = 2 bands under 2 groups: 8 steps, ceil(8 / 2) = 4 participations
  # per example, each a Poisson(q)-sampled Gaussian of multiplier sigma / (zeta S)
  # (Choquette-Choo et al. 2023, Theorem 4).
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(
      q, dpa.GaussianDpEvent(row["stddev"] / row["sensitivity"])), math.ceil(8 / 2)))
  report = dp.accounting.privacy_report(led, delta=DELTA)
  assert report.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
  assert any("Theorem 4" in a for a in report.assumptions)
  path = str(tmp_path / "ledger.json")
  led.save_json(path)
  loaded = dp.ledger.PrivacyLedger.load_json(path)
  assert dp.accounting.privacy_report(loaded, delta=DELTA).epsilon == report.epsilon
  assert loaded.to_dict() == d


def test_band_mf_fit_with_fewer_groups_than_bands_is_refused():
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"cycle length\) >= 2"):
    _fit_band_mf(num_bands=2, num_groups=1, steps_per_epoch=2, epochs=1)


def test_band_mf_fit_divides_by_the_expected_batch_of_one_group():
  """Noise off, per-example loss w . x with x = 0.1 (gradient x, norm < S): each step moves w
  by -lr x |B_t| / (q n / b), the public expected batch, not by -lr x (realized |B_t|)."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(
      1, use_bias=False, kernel_initializer="zeros")])
  x, y = np.full((120, 6), 0.1, np.float32), np.zeros((120, 1), np.float32)
  query = BandMFQuery(1.0, 0.0, template=model.trainable_variables, num_bands=2, num_steps=6)
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(dp_query=query, learning_rate=1.0),
                loss=lambda y_true, y_pred: y_pred[:, 0])

  def make():
    return cyclic_poisson_batches(x, y, expected_batch_size=10, num_groups=2,
                                  steps_per_epoch=6, seed=1)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # the test seed (not private)
    model.fit(make(), epochs=1, verbose=0)
    sizes = [float(np.sum(mask)) for _, _, mask in make()]   # the same samples again
  assert len(set(sizes)) > 1                                 # the realized size varies
  # times the pinned sum's clip shrink 1 / (1 + eta) (dp_query/summation; eta < 1e-3 here)
  np.testing.assert_allclose(model.trainable_variables[0].numpy()[:, 0],
                             -0.1 * sum(sizes) / 10.0, rtol=1e-3)


def test_tree_fit_on_shuffled_passes_is_recorded_and_accounted():
  """DP-FTRL (tree restarted every pass of 6 steps) in fit: tree rows under shuffle, one
  SingleEpochTreeAggregationDpEvent per pass (replace-one leaf sensitivity 2 S)."""
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  rng = np.random.RandomState(0)
  x, y = rng.randn(120, 6).astype("float32"), rng.randint(0, 3, 120)
  query = TreeAggregationQuery(1.0, 1.0, template=model.trainable_variables, restart_every=6)
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(dp_query=query, learning_rate=0.1),
                loss=LOSS)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # the test seed (not private)
    model.fit(shuffled_batches(x, y, batch_size=20, seed=1), epochs=2, verbose=0)
  d = model.ledger.to_dict()
  [run] = d["runs"]
  [row] = run["queries"]
  assert (d["num_samples"], d["passes"], run["policy"], row["type"]) == (
      12, 2, "shuffle", "tree_gaussian")
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_SPECIAL)
  acc.compose(dpa.SelfComposedDpEvent(dpa.SingleEpochTreeAggregationDpEvent(
      row["stddev"] / (2 * row["l2_norm_clip"]), 2 ** math.ceil(math.log2(6 + 1)) - 1), 2))
  assert dp.accounting.epsilon(model.ledger, DELTA) == pytest.approx(acc.get_epsilon(DELTA),
                                                                     rel=1e-9)
