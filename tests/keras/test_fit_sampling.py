"""DPModel.fit on arrays: Poisson by default, sampling="shuffle", validation_split, weights,
the one log line, the ledger journal, the budget stop on shuffled passes."""

import json
import math

import dp_accounting as dpa
import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import accounting
from tf_dpiter.keras.model import fit_sampling
from tests.keras import dp_keras_helpers as helpers

# Nightly tier (-m slow): the log line's other two settings and the shuffled
# weights case (the Poisson one stays).
SLOW_CASES = {
    "test_one_log_line_names_sampling_and_accountant[None-4-expected1]",
    "test_one_log_line_names_sampling_and_accountant[shuffle-None-expected2]",
    "test_sample_and_class_weights_are_honoured[shuffle]"}

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _compiled(z=1.1, microbatches=None, clip=1.0):
  model = helpers.small_seq()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(clip, z, microbatches, learning_rate=0.1),
                loss=LOSS)
  return model


@pytest.mark.parametrize("sampling,microbatches,expected", [
    (None, None, ["Poisson sampling", "q = 0.25", "sampling=None on arrays means Poisson",
                  "add/remove-one"]),
    (None, 4, ["shuffled passes", "sampling=None with num_microbatches=4", "replace-one"]),
    ("shuffle", None, ["shuffled passes", "sampling='shuffle'", "sensitivity 2S"]),
])
def test_one_log_line_names_sampling_and_accountant(capsys, sampling, microbatches, expected):
  x, y = helpers.small_data(64)
  model = _compiled(microbatches=microbatches)
  meter = dp.keras.callbacks.PrivacyMeter(1e-5)
  model.fit(x, y, batch_size=16, sampling=sampling, verbose=2, callbacks=[meter])
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("tf_dpiter DP-SGD")]
  assert len(lines) == 1
  for part in expected + ["RDP accountant", "delta = 1e-05"]:
    assert part in lines[0], (part, lines[0])
  model.fit(x, y, batch_size=16, sampling=sampling, verbose=0, callbacks=[meter])
  assert "tf_dpiter DP-SGD" not in capsys.readouterr().out


def test_validation_split_holds_out_the_last_fraction():
  x, y = helpers.small_data(50)
  model = _compiled()
  hist = model.fit(x, y, batch_size=10, epochs=1, validation_split=0.2, verbose=0)
  run = model.ledger.to_dict()["runs"][0]
  assert run["population_size"] == 40 and run["selection_probability"] == pytest.approx(0.25)
  assert model.ledger.to_dict()["num_samples"] == 4
  assert hist.history["val_loss"][0] == pytest.approx(
      model.evaluate(x[40:], y[40:], verbose=0), rel=1e-5)
  # the statement says whom the guarantee covers: the 40 training examples, not the 10 held out
  notes = model.privacy_statement(1e-5).notes
  assert any("validation_split=0.2" in n and "last 10 of the 50" in n
             and "training examples only" in n for n in notes), notes
  with pytest.raises(dp.errors.ParameterValueError, match=r"`validation_split` must be in "
                     r"\[0, 1\)\. Received: validation_split=1\.5"):
    model.fit(x, y, batch_size=10, validation_split=1.5, verbose=0)


def _update_norm(model, **fit_kwargs):
  x, y = helpers.small_data(64)
  before = [w.copy() for w in model.get_weights()]
  model.fit(x, y, batch_size=32, epochs=1, verbose=0, **fit_kwargs)
  return math.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(before, model.get_weights())))


@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
def test_sample_and_class_weights_are_honoured(sampling):
  # noise 0: the update is the clipped gradient sum, so weights 0 leave the model unchanged.
  # One model for the three fits (SGD without momentum: an update depends on the weights
  # only, and the first two fits must leave them as they were, which is asserted).
  model = _compiled(z=0.0)
  assert _update_norm(model, sampling=sampling, sample_weight=np.zeros(64)) == 0.0
  assert _update_norm(model, sampling=sampling, class_weight={0: 0.0, 1: 0.0, 2: 0.0}) == 0.0
  assert _update_norm(model, sampling=sampling, class_weight={0: 0.0}) > 0.0


def test_class_weight_to_sample_weight():
  cw = {0: 0.5, 2: 3.0}
  np.testing.assert_array_equal(
      fit_sampling.class_weight_to_sample_weight(np.array([0, 1, 2]), cw), [0.5, 1.0, 3.0])
  np.testing.assert_array_equal(
      fit_sampling.class_weight_to_sample_weight(np.eye(3)[[2, 0]], cw), [3.0, 0.5])
  with pytest.raises(ValueError, match="class_weight must be a dict"):
    fit_sampling.class_weight_to_sample_weight(np.array([0]), [1.0])
  with pytest.raises(ValueError, match="single label array"):
    fit_sampling.class_weight_to_sample_weight({"a": np.array([0])}, cw)


def test_keras_shuffle_argument_is_not_used_and_says_so():
  x, y = helpers.small_data(32)
  model = _compiled()
  with pytest.warns(UserWarning, match=r"fit\(shuffle=False\) is ignored"):
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
  assert model.ledger.to_dict()["runs"][0]["policy"] == "poisson"
  with pytest.raises(ValueError, match="sampling must be one of"):
    model.fit(x, y, batch_size=8, sampling="fixed_size", verbose=0)


def test_ledger_journal_resumes_in_a_new_model_and_refuses_tampering(tmp_path):
  x, y = helpers.small_data(64)
  path = str(tmp_path / "ledger.journal")
  first = _compiled()
  first.fit(x, y, batch_size=16, epochs=2, verbose=0, ledger_journal=path)
  assert int(first.ledger.sample_count.numpy()) == 8
  first.save(str(tmp_path / "m.keras"))
  second = keras.models.load_model(str(tmp_path / "m.keras"))   # a restart from the save
  second.fit(x, y, batch_size=16, epochs=1, verbose=0, ledger_journal=path)
  assert int(second.ledger.sample_count.numpy()) == 12
  # a fresh optimizer (iterations 0) was restored at no step of the journal: refused
  with pytest.raises(ValueError, match="not written at optimizer iterations=0"):
    _compiled().fit(x, y, batch_size=16, epochs=1, verbose=0, ledger_journal=path)
  assert accounting.epsilon(second.ledger, 1e-5) > accounting.epsilon(first.ledger, 1e-5)
  with open(path) as f:
    lines = f.read().splitlines()
  chunk = json.loads(lines[0])
  chunk["runs"][0]["queries"][0]["l2_norm_clip"] = 0.5   # claim a smaller clip
  with open(path, "w") as f:
    f.write("\n".join([json.dumps(chunk)] + lines[1:]) + "\n")
  with pytest.raises(ValueError, match="altered"):
    _compiled().fit(x, y, batch_size=16, verbose=0, ledger_journal=path)


def test_optimizer_ledger_journal_survives_save_and_load(tmp_path):
  # ModelCheckpoint-style restart: the journal path is in the optimizer's config, so the
  # model loaded from the checkpoint resumes every step taken before, without being told.
  x, y = helpers.small_data(64)
  path = str(tmp_path / "opt.journal")
  model = helpers.small_seq()
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1,
                                                       ledger_journal=path), loss=LOSS)
  model.fit(x, y, batch_size=16, epochs=2, verbose=0)
  model.save(str(tmp_path / "m.keras"))
  model.fit(x, y, batch_size=16, epochs=1, verbose=0)     # steps after the checkpoint
  loaded = keras.models.load_model(str(tmp_path / "m.keras"))
  assert loaded.optimizer.ledger_journal == path
  assert int(loaded.optimizer.iterations.numpy()) == 8
  loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert int(loaded.ledger.sample_count.numpy()) == 16   # 12 before + 4 re-run
  with pytest.raises(ValueError, match="ledger_journal"):
    dp.keras.DPKerasSGDOptimizer(1.0, 1.1, ledger_journal=3)


def test_ledger_journal_callback_with_key(tmp_path):
  x, y = helpers.small_data(64)
  path = str(tmp_path / "keyed.journal")
  model = _compiled()
  model.fit(x, y, batch_size=16, verbose=0,
            callbacks=[dp.keras.LedgerJournal(path, key="secret")])
  again = dp.keras.LedgerJournal(path, key="secret")
  model.save(str(tmp_path / "m.keras"))
  resumed = keras.models.load_model(str(tmp_path / "m.keras"))
  resumed.fit(x, y, batch_size=16, verbose=0, callbacks=[again])
  assert again.resumed == 4 and int(resumed.ledger.sample_count.numpy()) == 8
  with pytest.raises(ValueError, match="HMAC"):
    _compiled().fit(x, y, batch_size=16, verbose=0,
                    callbacks=[dp.keras.LedgerJournal(path, key="other")])


def _passes_epsilon(passes):
  """Epsilon of `passes` un-amplified Gaussians, noise 1.1 (float32) at sensitivity 2."""
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(float(np.float32(1.1)) / 2), passes))
  return acc.get_epsilon(1e-5)


def test_stop_at_privacy_budget_counts_passes():
  # Shuffled passes of 4 steps: a budget between 2 and 3 passes stops training after the
  # 8th step, since the 9th would start a third pass (one more mechanism).
  x, y = helpers.small_data(64)
  budget = 0.5 * (_passes_epsilon(2) + _passes_epsilon(3))
  model = _compiled()
  stop = dp.keras.callbacks.StopAtPrivacyBudget(epsilon=budget, delta=1e-5)
  model.fit(x, y, batch_size=16, epochs=5, sampling="shuffle", verbose=0, callbacks=[stop])
  assert int(model.ledger.sample_count.numpy()) == 8 and int(model.ledger.passes.numpy()) == 2
  assert accounting.epsilon(model.ledger, 1e-5) == pytest.approx(_passes_epsilon(2), rel=1e-9)
