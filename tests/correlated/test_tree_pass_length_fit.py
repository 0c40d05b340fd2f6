"""fit with noise="tree" checks restart_every R against the steps of a pass as the sampler
makes them, and a tree's state moves only with a step that released (needs the lead's patch
FT-note-1: fit passes the sampler's steps_per_pass to set_sampling; the noise draw waits for
the clipped sum).

Relation: replace one example (shuffled passes, no amplification; a leaf's sensitivity 2S);
unit: one example. shuffled_batches(n = 50, B = 6, drop_remainder=True): a pass is 8 steps,
so R = 8 trains (one tree per pass, epsilon as dp-accounting by hand) and R = 3 is refused
before any step, naming restart_every and its value.
"""

import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.errors import PrivacyConfigError
from tests.data import test_declare_shuffled_pass_length as _pass_length

N, B, CLIP, Z, DELTA = 50, 6, 1.0, 1.3, 1e-5

# Nightly (`-m slow`): the graph-mode case of the tree's moves. By default
# test_declare_shuffled_pass_length asserts the tree's step in graph mode on a filtered
# (unknown-cardinality) declared pipeline over 4 + 1 epochs
# (test_the_declared_pass_length_trains_and_is_charged_as_by_hand: 24 then 30 steps) and
# after a refused pass (test_a_pass_shorter_than_declared_is_refused_before_its_first_step
# [False]: 6); the XLA case below stays in the default suite.
SLOW_CASES = {"test_the_tree_moves_only_with_released_steps[False]"}


_model = _pass_length._model   # the same DP-FTRL model (CLIP, Z, restart_every)


def _data(n=N):
  rng = np.random.RandomState(0)
  return rng.randn(n, 6).astype("float32"), rng.randint(0, 3, n)


def test_drop_remainder_passes_take_restart_every_dividing_floor_n_over_b():
  warnings.simplefilter("ignore")
  model = _model(8)
  ds = dp.data.shuffled_batches(*_data(), batch_size=B, drop_remainder=True, seed=0)
  model.fit(ds, epochs=2, verbose=0)
  d = model.ledger.to_dict()
  assert (d["num_samples"], d["passes"]) == (16, 2)
  assert int(model.optimizer.noise_state().step) == 16
  [row] = d["runs"][0]["queries"]
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_SPECIAL)
  acc.compose(dpa.SingleEpochTreeAggregationDpEvent(row["stddev"] / (2 * CLIP), [8]), 2)
  assert dp.accounting.epsilon(model.ledger, DELTA) == pytest.approx(acc.get_epsilon(DELTA),
                                                                     rel=1e-9)


def test_drop_remainder_passes_refuse_restart_every_not_dividing_them():
  model = _model(3)
  ds = dp.data.shuffled_batches(*_data(), batch_size=B, drop_remainder=True, seed=0)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with pytest.raises(PrivacyConfigError, match=r"`restart_every` must divide .*a pass of "
                       r"this dataset is 8 steps \(its steps_per_pass\).*Received: "
                       r"restart_every=3"):
      model.fit(ds, epochs=1, verbose=0)
  assert int(model.optimizer.iterations.numpy()) == 0
  assert int(model.ledger.sample_count) == 0


@pytest.mark.parametrize("jit_compile", [False, True])
def test_the_tree_moves_only_with_released_steps(jit_compile):
  """An unknown-cardinality pipeline (a .filter) ends each epoch with one more call of the
  train function whose batch never comes; a refused pass does the same. Neither may draw
  noise or move the tree (its leaves would drift off the pass boundaries)."""
  warnings.simplefilter("ignore")
  x, y = _data(48)
  # the right pass length (8), unknown cardinality: before the patch the tree stood at step
  # 27 after 24 steps, tree [16, 19] holding pass 2's last step and pass 3's first two
  whole = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(48).filter(lambda a, b: True)
  model = _model(4, jit_compile)
  model.fit(dp.data.declare_shuffled(whole.batch(B), 48, B), epochs=3, verbose=0)
  assert int(model.optimizer.noise_state().step) == int(model.ledger.sample_count) == 24
  keep = np.arange(48) >= 12
  ds = (tf.data.Dataset.from_tensor_slices((x, y, keep)).shuffle(48)
        .filter(lambda a, b, k: k).map(lambda a, b, k: (a, b)).batch(B))
  model = _model(3, jit_compile)
  model.fit(dp.data.declare_shuffled(ds, 48, B, steps_per_pass=6), epochs=2, verbose=0)
  assert int(model.optimizer.noise_state().step) == int(model.ledger.sample_count) == 12
  # the refused pass: test_declare_shuffled_pass_length's
  # test_a_pass_shorter_than_declared_is_refused_before_its_first_step (same model, same
  # 6-batch passes declared 8, both jit_compile values) asserts the tree stands at step 6


def test_a_restored_run_continues_the_pass_count_or_is_refused_inside_a_tree(tmp_path):
  """model.save after one epoch, load_model, one more fit on a new declared pipeline: without
  its noise state (in no model file: it is the noise) the restored run is refused before any
  step; with it (save_noise_state / restore_noise_state) the restored ledger's passes
  continue (2, epsilon by hand for 2 passes); the mis-declared run (a 6-step pass, R = 4)
  restored inside tree 2 is refused before any step."""
  warnings.simplefilter("ignore")
  model = _pass_length._model(2)
  model.fit(_pass_length._filtered(steps_per_pass=6), epochs=1, verbose=0)
  model.save(str(tmp_path / "good.keras"))
  model.optimizer.private_step.save_noise_state(str(tmp_path / "good.npz"))
  refused = keras.models.load_model(str(tmp_path / "good.keras"))
  with pytest.raises(PrivacyConfigError, match=r"noise='tree': a correlated-noise run cannot "
                     r"resume from a saved model"):
    refused.fit(_pass_length._filtered(steps_per_pass=6), epochs=1, verbose=0)
  assert int(refused.ledger.sample_count) == int(refused.optimizer.iterations.numpy()) == 6
  resumed = keras.models.load_model(str(tmp_path / "good.keras"))
  resumed.optimizer.private_step.restore_noise_state(str(tmp_path / "good.npz"))
  resumed.fit(_pass_length._filtered(steps_per_pass=6), epochs=1, verbose=0)
  d = resumed.ledger.to_dict()
  assert (d["num_samples"], d["passes"]) == (12, 2)
  assert int(resumed.optimizer.noise_state().step) == 12   # no phantom leaf (hunk 3)
  assert dp.accounting.epsilon(resumed.ledger, DELTA) == pytest.approx(
      _pass_length._tree_epsilon(resumed, 2, 6, 2), rel=1e-9)
  model = _pass_length._model(4)
  model.fit(_pass_length._filtered(), epochs=1, verbose=0)
  model.save(str(tmp_path / "bad.keras"))
  model.optimizer.private_step.save_noise_state(str(tmp_path / "bad.npz"))
  resumed = keras.models.load_model(str(tmp_path / "bad.keras"))
  resumed.optimizer.private_step.restore_noise_state(str(tmp_path / "bad.npz"))
  with pytest.raises(PrivacyConfigError, match=r"restart_every=4: the mechanism is at step "
                     r"\d+, inside a tree"):
    resumed.fit(_pass_length._filtered(), epochs=1, verbose=0)
  d = resumed.ledger.to_dict()
  assert (d["num_samples"], d["passes"]) == (6, 1)
