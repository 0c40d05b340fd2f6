"""Cyclic Poisson's schedule across fits, prefetch, new datasets and restores (issue 26, 1-2).

The real pipeline and training step, noise 0: a linear model w . x with x the one-hot code
of the example and loss w . x has gradient x (norm 1 = the clip), so each step moves w by
-lr x (examples in the sample) / (q n / b): the weights read back after every step show
which examples joined it. Participations and gaps are then checked against the ledger's own
claim (the cycle length b of its rows, and the participations its accounting charges).
"""

import math
import warnings

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.accounting import accountant
from tf_dpiter.accounting import ledger_events
from tf_dpiter.data import cyclic_poisson
from tf_dpiter.errors import PrivacyConfigError

from tests.privacy import privacy_joins  # noqa: E402

# Nightly tier (-m slow, besides the marks below): by default each noise kind runs
# each check once: four fits (blt, both ways), save/load then fit (band_mf), one fit of
# several epochs (iid).
SLOW_CASES = {
    "test_four_fits_of_five_steps_keep_the_ledgers_claim[same_dataset-iid]",
    "test_four_fits_of_five_steps_keep_the_ledgers_claim[same_dataset-band_mf]",
    "test_save_load_model_then_fit_continues_the_ledgers_cycle[iid]",
    "test_one_fit_of_several_epochs_keeps_the_ledgers_claim[band_mf]",
    # a new dataset per fit of the cycle: test_policy_matrix.py's [cyclic_poisson-new_dataset]
    # (the same claim, iid noise); blt across fits: [same_dataset-blt]
    "test_four_fits_of_five_steps_keep_the_ledgers_claim[new_dataset-blt]"}

N, B, STEPS = 24, 4, 5   # q = 1: every example of the active group joins
# fits (or epochs) of STEPS steps: they start at steps 0, 5, 10, 15, i.e. in each of the b = 4
# groups once (5 is not a multiple of b), so every way a fit can start inside the cycle is met
FITS = 4
HORIZON = 40   # the correlated mechanisms' num_steps (more than any test here runs)


_Recorder = privacy_joins.JoinRecorder


def _model(noise, journal=None):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((N,)), keras.layers.Dense(
      1, use_bias=False, kernel_initializer="zeros")])
  params = {"band_mf": {"num_bands": B, "num_steps": HORIZON},
            "blt": {"num_steps": HORIZON, "num_buffers": 2, "min_separation": B},
            "iid": {}}[noise]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # noise 0: not private, on purpose
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 0.0, noise=noise, learning_rate=1.0,
                                       ledger_journal=journal, **params)
  model.compile(optimizer=opt, loss=lambda y_true, y_pred: y_pred[:, 0])
  return model


def _dataset():
  x = np.eye(N, dtype=np.float32)
  y = np.zeros((N, 1), np.float32)
  return cyclic_poisson.cyclic_poisson_batches(x, y, expected_batch_size=N / B, num_groups=B,
                                              steps_per_epoch=64)


def _check_against_claim(model, joined):
  """Participations and gaps of every example vs the ledger's claim."""
  samples, _ = model.ledger.get_arrays()
  runs, _ = accountant.ledger_runs(model.ledger)
  groups = [g for g in ledger_events.groups_from_runs(runs) if g.count]
  claimed = sum(g.participations for g in groups)
  b = min(int(g.sample_size) for g in groups)
  steps_of = {i: [t for t, s in enumerate(joined) if i in s] for i in range(N)}
  most = max(len(s) for s in steps_of.values())
  gap = min((np.diff(s).min() for s in steps_of.values() if len(s) > 1), default=math.inf)
  assert len(joined) == samples.shape[0] == FITS * STEPS
  assert most <= claimed, (most, claimed)
  assert gap >= b, (gap, b)
  return most, gap, claimed


# A new dataset for each fit under iid and band_mf noise is also
# test_save_load_model_then_fit_continues_the_ledgers_cycle's (three new datasets after the
# first fit, the same claim checked): those two cells run with -m slow.
@pytest.mark.parametrize("noise,how", [
    pytest.param(noise, how, id=f"{how}-{noise}",
                 marks=pytest.mark.slow if how == "new_dataset" and noise != "blt" else ())
    for how in ("same_dataset", "new_dataset") for noise in ("iid", "band_mf", "blt")])
def test_four_fits_of_five_steps_keep_the_ledgers_claim(noise, how):
  """n = 24, 4 groups, q = 1, 4 fits of 5 steps (each starts in another group): the 16-step
  prefetch of each fit is dropped, and the next fit must start at the group after the last
  step taken."""
  model = _model(noise)
  joined = []
  ds = _dataset()
  for _ in range(FITS):
    if how == "new_dataset":
      ds = _dataset()
    model.fit(ds, epochs=1, steps_per_epoch=STEPS, verbose=0, callbacks=[_Recorder(joined)])
  most, gap, claimed = _check_against_claim(model, joined)
  assert (most, gap, claimed) == (5, 4, 5)   # exactly every b-th step, 20 / 4 times
  assert int(model.ledger.cycle_position.numpy()) == FITS * STEPS


def test_removing_one_example_moves_no_other_examples_group():
  rng = np.random.RandomState(0)
  x = rng.randn(40, 3).astype(np.float32)
  y = rng.randint(0, 5, 40)
  full = cyclic_poisson.record_identities(x, y)
  for drop in (0, 17, 39):
    keep = np.setdiff1d(np.arange(40), [drop])
    part = cyclic_poisson.record_identities(x[keep], y[keep])
    for b in (2, 3, 7):
      a = cyclic_poisson.CyclicPoissonSampler(40, b, 1, seed=0, identities=full)
      c = cyclic_poisson.CyclicPoissonSampler(39, b, 1, seed=0, identities=part)
      assert [a.group_of(int(i)) for i in keep] == [c.group_of(j) for j in range(39)]


def test_a_backup_restore_that_reruns_band_mf_rows_is_refused_before_any_step(tmp_path):
  model = _model("band_mf")
  ds = _dataset()
  model.fit(ds, epochs=1, steps_per_epoch=STEPS, verbose=0)
  # a restore rolled the optimizer back 2 steps while the ledger kept them (journal)
  model.optimizer.iterations.assign(STEPS - 2)
  before = model.get_weights()
  with pytest.raises(PrivacyConfigError, match=r"holds 5 steps but the optimizer is at "
                                               r"iteration 3.*rerun rows"):
    model.fit(ds, epochs=1, steps_per_epoch=STEPS, verbose=0)
  for a, b in zip(before, model.get_weights()):
    np.testing.assert_array_equal(a, b)
  assert int(model.ledger.sample_count.numpy()) == STEPS


class _CrashAt(keras.callbacks.Callback):

  def __init__(self, step):
    super().__init__()
    self.step = step

  def on_train_batch_end(self, batch, logs=None):
    if int(self.model.ledger.sample_count.numpy()) == self.step:
      raise RuntimeError("crash")


def test_a_crash_and_backup_and_restore_continue_the_ledgers_cycle(tmp_path):
  """iid noise: a crash 3 steps into the second epoch, a new model resumed by
  BackupAndRestore (weights at the epoch boundary, ledger from the journal: the 3 steps run
  again are charged). The schedule continues at the ledger's position, so every step ever
  run (reruns included) keeps the claim."""
  joined = []
  backup = str(tmp_path / "backup")
  first = _model("iid")
  with pytest.raises(RuntimeError, match="crash"):
    first.fit(_dataset(), epochs=3, steps_per_epoch=STEPS, verbose=0,
              callbacks=[_Recorder(joined), keras.callbacks.BackupAndRestore(backup),
                         _CrashAt(STEPS + 3)])
  resumed = _model("iid")
  resumed.fit(_dataset(), epochs=3, steps_per_epoch=STEPS, verbose=0,
              callbacks=[_Recorder(joined), keras.callbacks.BackupAndRestore(backup)])
  assert int(resumed.optimizer.iterations.numpy()) == 3 * STEPS
  samples, _ = resumed.ledger.get_arrays()
  assert samples.shape[0] == len(joined) == 3 * STEPS + 3
  runs, _ = accountant.ledger_runs(resumed.ledger)
  groups = [g for g in ledger_events.groups_from_runs(runs) if g.count]
  claimed = sum(g.participations for g in groups)
  steps_of = [[t for t, s in enumerate(joined) if i in s] for i in range(N)]
  assert max(len(s) for s in steps_of) <= claimed == math.ceil((3 * STEPS + 3) / B)
  assert min(np.diff(s).min() for s in steps_of if len(s) > 1) >= B


@pytest.mark.parametrize("noise", ["iid", "band_mf"])
def test_one_fit_of_several_epochs_keeps_the_ledgers_claim(noise):
  """Keras makes a new iterator at each epoch's end and, without fit's steps_per_epoch,
  replaces it at the next epoch's start: the dropped one's prefetch must not shift the cycle
  (5 steps per epoch, not a multiple of b = 4)."""
  model = _model(noise)
  x, y = np.eye(N, dtype=np.float32), np.zeros((N, 1), np.float32)
  ds = cyclic_poisson.cyclic_poisson_batches(x, y, expected_batch_size=N / B, num_groups=B,
                                             steps_per_epoch=STEPS)
  joined = []
  model.fit(ds, epochs=FITS, verbose=0, callbacks=[_Recorder(joined)])
  assert _check_against_claim(model, joined) == (5, 4, 5)


def test_a_repeated_cyclic_dataset_is_refused():
  x, y = np.eye(N, dtype=np.float32), np.zeros((N, 1), np.float32)
  ds = cyclic_poisson.cyclic_poisson_batches(x, y, expected_batch_size=N / B, num_groups=B)
  model = _model("iid")
  with pytest.raises(ValueError, match=r"cannot be repeated"):
    model.fit(ds.repeat(), epochs=1, steps_per_epoch=STEPS, verbose=0)


@pytest.mark.parametrize("noise", ["iid", "band_mf"])
def test_save_load_model_then_fit_continues_the_ledgers_cycle(noise, tmp_path):
  """model.save -> keras.models.load_model -> fit (a new dataset; the journal carries the
  ledger): the cycle continues at the ledger's position and the partition is the same (a
  hash of each example's record), so every step keeps the claim."""
  model = _model(noise, journal=str(tmp_path / "run.journal"))
  joined = []
  model.fit(_dataset(), epochs=1, steps_per_epoch=STEPS, verbose=0, callbacks=[_Recorder(joined)])
  model.save(str(tmp_path / "m.keras"))
  if noise != "iid":   # its noise state is in no model file (the noise): its private file
    model.optimizer.private_step.save_noise_state(str(tmp_path / "noise.npz"))
  loaded = keras.models.load_model(str(tmp_path / "m.keras"), safe_mode=False)
  if noise != "iid":
    loaded.optimizer.private_step.restore_noise_state(str(tmp_path / "noise.npz"))
  for _ in range(FITS - 1):
    loaded.fit(_dataset(), epochs=1, steps_per_epoch=STEPS, verbose=0,
               callbacks=[_Recorder(joined)])
  assert int(loaded.ledger.cycle_position.numpy()) == FITS * STEPS
  assert _check_against_claim(loaded, joined) == (5, 4, 5)


def test_identities_of_text_records_are_their_content():
  texts = np.array(["a cat", "a dog", "a cow"], dtype=object)
  copy = np.array([str(t) for t in texts], dtype=object)     # other objects, same content
  assert cyclic_poisson.record_identities(texts) == cyclic_poisson.record_identities(copy)
  assert len(set(cyclic_poisson.record_identities(texts))) == 3


def test_an_iterator_started_inside_a_step_starts_at_the_position_fit_read_between_steps():
  """The generator starts inside the step that pulls its first batch, and that step's own
  ledger write may already have run: fit's snapshot (taken between steps) wins over the live
  position when they differ by that one step; a stale snapshot (more than one step behind)
  and no snapshot read the ledger."""
  ledger = dp.ledger.PrivacyLedger()
  sampler = cyclic_poisson.CyclicPoissonSampler(N, B, N / B, seed=0)
  sampler.resume_at(ledger)
  ledger._v.cycle_position.assign(5)   # pylint: disable=protected-access  (the running step wrote)
  sampler.snapshot_position(4)
  first = sampler.start_iterator()()
  assert {sampler.group_of(int(i)) for i in first} == {4 % B}
  sampler.snapshot_position(2)       # stale: a crashed fit's
  assert {sampler.group_of(int(i)) for i in sampler.start_iterator()()} == {5 % B}
  sampler.snapshot_position(None)
  assert {sampler.group_of(int(i)) for i in sampler.start_iterator()()} == {5 % B}
