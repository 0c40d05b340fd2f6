"""TF Privacy's membership-inference codelab, call by call, through `dp.auditing`.

The codelab trains a model for a few rounds and after each round runs the attacks with a
`PrivacyReportMetadata` (`run_attacks(..., privacy_report_metadata=, return_slice_indices=)`),
collects the results in an `AttackResultsCollection`, plots the privacy report over epochs and
against accuracy and the ROC curve, saves and loads the results, prints their data frame and
reads the per-example membership scores. Here the "model" is synthetic logits whose members
are fitted more tightly each epoch (fast, deterministic); every figure the API reports is
checked against a value computed here independently.
"""

import os
import pickle
import sys

import matplotlib
import numpy as np
import pytest

import tf_dpiter as dp

matplotlib.use("Agg")

_K, _N_IN, _N_OUT = 4, 240, 200
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _pairwise_auc(pos, neg):
  """P[pos > neg] + 1/2 P[tie], counting all pairs."""
  pos, neg = np.asarray(pos)[:, None], np.asarray(neg)[None, :]
  return float(np.mean((pos > neg) + 0.5 * (pos == neg)))


def _cross_entropy(z, y):
  z = z - z.max(axis=1, keepdims=True)
  return np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y]


def _epoch_outputs(epoch, rng):
  """Logits and labels after `epoch` rounds: the members' true-class margin grows faster."""
  y_in, y_out = rng.integers(0, _K, _N_IN), rng.integers(0, _K, _N_OUT)
  z_in = rng.normal(size=(_N_IN, _K)) + (0.5 + 0.6 * epoch) * np.eye(_K)[y_in]
  z_out = rng.normal(size=(_N_OUT, _K)) + 0.5 * np.eye(_K)[y_out]
  return z_in, z_out, y_in, y_out


_ALL_SLICES = dict(entire_dataset=True, by_class=True, by_classification_correctness=True)


_BOTH = (dp.auditing.AttackType.THRESHOLD_ATTACK, dp.auditing.AttackType.LOGISTIC_REGRESSION)


def _run_epoch(epoch, label="small model", seed=0, slices=None, attack_types=_BOTH, **kwargs):
  rng = np.random.default_rng(100 * seed + epoch)
  z_in, z_out, y_in, y_out = _epoch_outputs(epoch, rng)
  data = dp.auditing.AttackInputData(logits_train=z_in, logits_test=z_out,
                                     labels_train=y_in, labels_test=y_out)
  meta = dp.auditing.PrivacyReportMetadata(epoch_num=10 * epoch, model_variant_label=label)
  results = dp.auditing.run_attacks(
      data, dp.auditing.SlicingSpec(**(slices or {"entire_dataset": True})),
      attack_types=attack_types, privacy_report_metadata=meta, **kwargs)
  return results, (z_in, z_out, y_in, y_out)


@pytest.fixture(scope="module")
def last_epoch():
  return _run_epoch(3, slices=_ALL_SLICES, return_slice_indices=True, epsilon=2.0, delta=1e-5)


def test_metadata_is_kept_and_its_missing_fields_are_computed(last_epoch):
  results, (z_in, z_out, y_in, y_out) = last_epoch
  meta = results.privacy_report_metadata
  assert (meta.epoch_num, meta.model_variant_label) == (30, "small model")
  assert meta.accuracy_train == pytest.approx(np.mean(z_in.argmax(1) == y_in), abs=1e-12)
  assert meta.accuracy_test == pytest.approx(np.mean(z_out.argmax(1) == y_out), abs=1e-12)
  assert meta.loss_train == pytest.approx(np.mean(_cross_entropy(z_in, y_in)), rel=1e-9)
  assert meta.loss_test == pytest.approx(np.mean(_cross_entropy(z_out, y_out)), rel=1e-9)
  given = dp.auditing.PrivacyReportMetadata(accuracy_train=0.25, epoch_num=1)
  data = dp.auditing.AttackInputData(logits_train=z_in, logits_test=z_out, labels_train=y_in,
                                     labels_test=y_out)
  kept = dp.auditing.run_attacks(data, privacy_report_metadata=given).privacy_report_metadata
  assert kept.accuracy_train == 0.25 and given.accuracy_test is None  # the input is not changed
  assert kept.accuracy_test == pytest.approx(meta.accuracy_test)
  with pytest.raises(dp.ParameterTypeError, match="Received: privacy_report_metadata="):
    dp.auditing.run_attacks(data, privacy_report_metadata={"epoch_num": 1})
  with pytest.raises(dp.ParameterTypeError, match="Received: epoch_num=1.5"):
    dp.auditing.PrivacyReportMetadata(epoch_num=1.5)


def test_membership_scores_give_the_reported_auc_and_advantage(last_epoch):
  results, (z_in, z_out, y_in, y_out) = last_epoch
  l_in, l_out = _cross_entropy(z_in, y_in), _cross_entropy(z_out, y_out)
  for r in results.single_attack_results:
    s_in, s_out = r.membership_scores_train, r.membership_scores_test
    assert (s_in.shape, s_out.shape) == ((r.num_train,), (r.num_test,))
    assert r.auc == pytest.approx(_pairwise_auc(s_in, s_out), abs=1e-12)
    assert r.roc_curve.get_auc() == pytest.approx(r.auc, abs=1e-12)
    assert r.roc_curve.get_attacker_advantage() == r.get_attacker_advantage()
  whole = results.single_attack_results[0]  # THRESHOLD_ATTACK on the entire dataset
  assert str(whole.attack_type) == "THRESHOLD_ATTACK" and whole.slice_spec.entire_dataset
  np.testing.assert_allclose(whole.membership_scores_train, -l_in, rtol=1e-9)
  np.testing.assert_allclose(whole.membership_scores_test, -l_out, rtol=1e-9)
  # members are fitted tighter: the attack works, and more than the logistic one's chance
  assert whole.auc > 0.7 and results.single_attack_results[1].auc > 0.7


def test_slice_indices_are_returned_on_slices_only(last_epoch):
  results, (z_in, z_out, y_in, y_out) = last_epoch
  for r in results.single_attack_results:
    if r.slice_spec.entire_dataset:
      assert r.train_indices is None and r.test_indices is None
    elif r.slice_spec.feature == "class":
      np.testing.assert_array_equal(r.train_indices, np.flatnonzero(y_in == r.slice_spec.value))
      np.testing.assert_array_equal(r.test_indices, np.flatnonzero(y_out == r.slice_spec.value))
    else:
      ok = z_out.argmax(1) == y_out
      np.testing.assert_array_equal(r.test_indices, np.flatnonzero(ok == r.slice_spec.value))
    if r.train_indices is not None and str(r.attack_type) == "THRESHOLD_ATTACK":
      l_in = _cross_entropy(z_in, y_in)
      np.testing.assert_allclose(r.membership_scores_train, -l_in[r.train_indices], rtol=1e-9)
  by_class = _run_epoch(3, slices={"by_class": True},
                        attack_types=(dp.auditing.AttackType.THRESHOLD_ATTACK,))[0]
  assert by_class.single_attack_results[0].train_indices is None  # off by default


def test_ppv_matches_a_count_over_thresholds(last_epoch):
  results, _ = last_epoch
  for r in results.single_attack_results[:4]:
    s_in, s_out = r.membership_scores_train, r.membership_scores_test
    best = r.num_train / (r.num_train + r.num_test)   # accept nothing: the prior
    for t in np.unique(np.r_[s_in, s_out]):
      tp, fp = np.sum(s_in >= t), np.sum(s_out >= t)
      best = max(best, tp / (tp + fp))
    assert r.get_ppv() == pytest.approx(best, abs=1e-12)


def test_save_and_load_round_trip(last_epoch, tmp_path):
  results, _ = last_epoch
  path = str(tmp_path / "results.pickle")  # the codelab's file name: the format is ours
  assert results.save(path) == path
  loaded = dp.auditing.AttackResults.load(path)
  assert loaded == results
  assert loaded.summary(by_slices=True) == results.summary(by_slices=True)
  r0, l0 = results.single_attack_results[3], loaded.single_attack_results[3]
  np.testing.assert_array_equal(l0.membership_scores_test, r0.membership_scores_test)
  np.testing.assert_array_equal(l0.train_indices, r0.train_indices)
  assert l0.slice_spec == r0.slice_spec and type(l0.slice_spec.value) is type(r0.slice_spec.value)
  assert loaded.privacy_report_metadata == results.privacy_report_metadata
  assert loaded.privacy_bound == results.privacy_bound
  bad = tmp_path / "tf_privacy.pickle"
  bad.write_bytes(pickle.dumps({"single_attack_results": []}))
  with pytest.raises(dp.ParameterValueError, match="written by AttackResults.save"):
    dp.auditing.AttackResults.load(str(bad))


def test_data_frame_columns_and_values(last_epoch):
  results, _ = last_epoch
  df = results.calculate_pd_dataframe()
  assert list(df.columns) == [
      "slice feature", "slice value", "train size", "test size", "attack type",
      "Attacker advantage", "Positive predictive value", "AUC", "epsilon", "delta",
      "AUC bound", "Attacker advantage bound"]
  assert len(df) == len(results.single_attack_results) == 2 * (1 + _K + 2)
  for (_, row), r in zip(df.iterrows(), results.single_attack_results):
    feature = "Entire dataset" if r.slice_spec.entire_dataset else r.slice_spec.feature
    value = "" if r.slice_spec.entire_dataset else str(r.slice_spec.value)
    assert (row["slice feature"], row["slice value"]) == (feature, value)
    assert (row["train size"], row["test size"]) == (r.num_train, r.num_test)
    assert row["attack type"] == r.attack_type.name
    assert row["AUC"] == r.auc and row["Attacker advantage"] == r.attacker_advantage
    assert row["Positive predictive value"] == r.get_ppv()
  assert set(df["AUC bound"]) == {results.privacy_bound.max_auc}
  assert set(df["attack type"]) == {"THRESHOLD_ATTACK", "LOGISTIC_REGRESSION"}


def test_data_frame_without_pandas_names_the_extra(last_epoch, monkeypatch):
  monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` raises ImportError
  with pytest.raises(ImportError, match=r"tf_dpiter\[report\]"):
    last_epoch[0].calculate_pd_dataframe()


def test_collection_over_epochs_saves_loads_and_plots(tmp_path):
  collection = dp.auditing.AttackResultsCollection([])
  for label, seed in (("two-layer", 0), ("three-layer", 1)):
    for epoch in (1, 2, 3):
      collection.append(_run_epoch(epoch, label, seed)[0])
  assert [r.privacy_report_metadata.epoch_num for r in collection.attack_results_list] == \
      [10, 20, 30] * 2
  whole_auc = [r.single_attack_results[0].auc for r in collection.attack_results_list[:3]]
  assert whole_auc == sorted(whole_auc)   # the synthetic model overfits more each epoch
  written = collection.save(str(tmp_path / "epochs"))
  assert [os.path.basename(p) for p in written][:2] == ["00000_two-layer_epoch_10.npz",
                                                        "00001_two-layer_epoch_20.npz"]
  assert dp.auditing.AttackResultsCollection.load(str(tmp_path / "epochs")) == collection
  metrics = [dp.auditing.PrivacyMetric.ATTACKER_ADVANTAGE, dp.auditing.PrivacyMetric.AUC]
  figures = {"epochs.png": dp.auditing.plot_by_epochs(collection, metrics),
             "utility.png": dp.auditing.plot_privacy_vs_accuracy(collection, metrics),
             "roc.png": dp.auditing.plot_roc_curve(
                 collection.attack_results_list[-1].get_result_with_max_auc().roc_curve)}
  assert len(figures["epochs.png"].axes) == 2
  # one line per (variant, attack) in each panel, with x = the epochs
  lines = figures["epochs.png"].axes[1].get_lines()
  assert len(lines) == 4 and list(lines[0].get_xdata()) == [10.0, 20.0, 30.0]
  np.testing.assert_allclose(lines[0].get_ydata(), whole_auc)
  for name, fig in figures.items():
    path = dp.auditing.save_plot(fig, str(tmp_path / name))
    with open(path, "rb") as f:
      head = f.read(8)
    assert head == _PNG_MAGIC and os.path.getsize(path) > 5000, name


def test_plots_draw_the_dp_bound_and_refuse_missing_metadata(tmp_path):
  collection = dp.auditing.AttackResultsCollection(
      [_run_epoch(e, epsilon=float(e), delta=1e-5)[0] for e in (1, 2)])
  fig = dp.auditing.plot_by_epochs(collection, [dp.auditing.PrivacyMetric.AUC])
  bound_lines = [l for l in fig.axes[0].get_lines() if l.get_label().endswith("DP bound")]
  assert len(bound_lines) == 1   # one per model variant (the bound is the run's, not an attack's)
  np.testing.assert_allclose(bound_lines[0].get_ydata(),
                             [r.privacy_bound.max_auc for r in collection.attack_results_list])
  assert os.path.getsize(dp.auditing.save_plot(fig, str(tmp_path / "b.png"))) > 5000
  no_epoch = dp.auditing.run_attacks(dp.auditing.AttackInputData(
      loss_train=np.arange(5.0), loss_test=np.arange(5.0) + 1))
  with pytest.raises(dp.ParameterValueError, match="epoch_num"):
    dp.auditing.plot_by_epochs([no_epoch], [dp.auditing.PrivacyMetric.AUC])
  with pytest.raises(dp.ParameterTypeError, match="Received: results="):
    dp.auditing.plot_privacy_vs_accuracy("results", [dp.auditing.PrivacyMetric.AUC])


@pytest.mark.slow
def test_codelab_loop_on_a_trained_dp_keras_model(tmp_path):
  """The codelab's loop on a real DP Keras model (about 20 s on 2 loaded cores, mostly the
  first fit's tracing; the default suite runs the same calls on synthetic logits above)."""
  import keras  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(256, 8)).astype("float32")
  y = rng.integers(0, 3, 256)
  x_tr, y_tr, x_te, y_te = x[:128], y[:128], x[128:], y[128:]
  model = dp.keras.DPSequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 0.8, learning_rate=0.5),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  collection = dp.auditing.AttackResultsCollection([])
  for rnd in (1, 2):
    model.fit(x_tr, y_tr, batch_size=32, epochs=2, verbose=0)
    z_tr, z_te = model.predict(x_tr, verbose=0), model.predict(x_te, verbose=0)
    eps = model.privacy_statement(1e-5).epsilon
    collection.append(dp.auditing.run_attacks(
        dp.auditing.AttackInputData(logits_train=z_tr, logits_test=z_te, labels_train=y_tr,
                                    labels_test=y_te),
        dp.auditing.SlicingSpec(entire_dataset=True, by_class=True), attack_types=_BOTH,
        privacy_report_metadata=dp.auditing.PrivacyReportMetadata(epoch_num=2 * rnd),
        epsilon=eps, delta=1e-5))
    res = collection.attack_results_list[-1]
    assert res.privacy_report_metadata.accuracy_train == pytest.approx(
        np.mean(z_tr.argmax(1) == y_tr))
    whole = res.single_attack_results[0]
    assert whole.auc == pytest.approx(_pairwise_auc(-_cross_entropy(z_tr.astype(float), y_tr),
                                                    -_cross_entropy(z_te.astype(float), y_te)),
                                      abs=1e-6)
    assert whole.auc <= res.privacy_bound.max_auc
  eps1, eps2 = (r.privacy_bound.epsilon for r in collection.attack_results_list)
  assert 0 < eps1 < eps2
  collection.save(str(tmp_path / "runs"))
  assert dp.auditing.AttackResultsCollection.load(str(tmp_path / "runs")) == collection
  path = dp.auditing.save_plot(dp.auditing.plot_by_epochs(
      collection, [dp.auditing.PrivacyMetric.AUC]), str(tmp_path / "epochs.png"))
  assert os.path.getsize(path) > 5000
