"""fit on arrays keeps ONE endless iterator of Poisson samples for all its epochs: which example
joins which step, against an independent replay of the sampler, and what the ledger charges.

The real pipeline (DPModel.fit on arrays), noise 0, a one-hot linear model whose update shows
which examples each step used (tests/privacy/privacy_joins.py). The sampler's generator is
seeded per fit here (sampling.make_rng patched to Philox(seed_k) for the k-th generator), so
the k-th step of a fit must have joined exactly the k-th draw of
`poisson_indices(Philox(seed_k), 0, n, q)` replayed independently: the same as building one
iterator per epoch from one generator; samples drawn ahead and not used (prefetch, the fit's
end, an interruption) are never used later; every step that ran is charged exactly once.
"""

import os
import warnings

import keras
import numpy as np
import pytest

from tf_dpiter.data import sampling

from tests.privacy import privacy_joins

# Nightly tier (-m slow): the replayed draws without steps_per_epoch and at 5 x 2
# (4 steps x 3 epochs stays: the same order check across epochs).
SLOW_CASES = {
    "test_steps_join_the_replayed_draws_in_order[None-3]",
    "test_steps_join_the_replayed_draws_in_order[5-2]"}

N, B = 24, 4          # round(N / B) = 6 steps per epoch


def _model():
  return privacy_joins.one_hot_model(N)


def _data():
  return privacy_joins.one_hot_data(N)


@pytest.fixture(name="seeds")
def _seeded_generators(monkeypatch):
  """sampling.make_rng returns Philox(1000 + k) for its k-th call; yields the seeds used."""
  seeds = []

  def seeded(seed, who="poisson_batches", stacklevel=3):
    del seed, who, stacklevel
    seeds.append(1000 + len(seeds))
    return np.random.Generator(np.random.Philox(seeds[-1]))

  monkeypatch.setattr(sampling, "make_rng", seeded)
  return seeds


def _replay(seed, steps, q=B / N):
  """The first `steps` Poisson samples of a generator seeded `seed`, drawn one after another
  (what one iterator per epoch over the same generator draws)."""
  rng = np.random.Generator(np.random.Philox(seed))
  return [set(sampling.poisson_indices(rng, 0, N, q).tolist()) for _ in range(steps)]


def _fit(model, joined, **kwargs):
  x, y = _data()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return model.fit(x, y, batch_size=B, verbose=0,
                     callbacks=[privacy_joins.JoinRecorder(joined)] + kwargs.pop("callbacks", []),
                     **kwargs)


def _charged(model):
  return int(model.ledger.sample_count.numpy())


@pytest.mark.parametrize("steps_per_epoch,epochs", [(None, 3), (4, 3), (5, 2)])
def test_steps_join_the_replayed_draws_in_order(seeds, steps_per_epoch, epochs):
  """Several epochs of one fit: the k-th step joined the k-th draw of the fit's generator
  (5 steps per epoch does not divide the 6 of a pass); one generator for the whole fit."""
  model, joined = _model(), []
  _fit(model, joined, epochs=epochs, steps_per_epoch=steps_per_epoch)
  steps = epochs * (steps_per_epoch or N // B)
  assert len(seeds) == 1
  assert joined == _replay(seeds[0], steps)
  assert _charged(model) == steps == int(model.optimizer.iterations.numpy())
  assert len({frozenset(s) for s in joined}) > 1      # different samples, not one repeated


def test_second_fit_and_initial_epoch_start_a_new_generator(seeds):
  """A second fit (with initial_epoch) never uses a sample the first drew ahead: it joins
  its own generator's draws from the first; the ledger charges the steps of both."""
  model, first, second = _model(), [], []
  _fit(model, first, epochs=2)
  _fit(model, second, epochs=4, initial_epoch=2, steps_per_epoch=3)
  assert len(seeds) == 2
  assert first == _replay(seeds[0], 12)
  assert second == _replay(seeds[1], 6)
  assert _charged(model) == 18 == int(model.optimizer.iterations.numpy())


class _RaiseAt(keras.callbacks.Callback):
  def __init__(self, step):
    super().__init__()
    self.step, self.seen = step, 0

  def on_train_batch_end(self, batch, logs=None):
    self.seen += 1
    if self.seen == self.step:
      raise KeyboardInterrupt("interrupted mid-epoch")


class _StopAt(keras.callbacks.Callback):
  def __init__(self, step):
    super().__init__()
    self.step, self.seen = step, 0

  def on_train_batch_end(self, batch, logs=None):
    self.seen += 1
    if self.seen == self.step:
      self.model.stop_training = True


def test_interrupted_fit_charges_the_steps_it_ran_and_the_next_fit_draws_anew(seeds):
  model, first, second, third = _model(), [], [], []
  with pytest.raises(KeyboardInterrupt):
    _fit(model, first, epochs=3, callbacks=[_RaiseAt(8)])   # in the second epoch
  assert first == _replay(seeds[0], 8)
  assert _charged(model) == 8
  _fit(model, second, epochs=3, callbacks=[_StopAt(4)])
  assert second == _replay(seeds[1], len(second))
  assert _charged(model) == 8 + len(second) == int(model.optimizer.iterations.numpy())
  _fit(model, third, epochs=1)
  assert third == _replay(seeds[2], 6)
  assert _charged(model) == 8 + len(second) + 6


def test_validation_and_evaluate_change_no_training_sample(seeds):
  """validation_data in the fit and an evaluate between fits: the training steps still join
  their generator's draws in order and only training steps are charged."""
  x, y = _data()
  model, first, second = _model(), [], []
  _fit(model, first, epochs=2, validation_data=(x[:8], y[:8]))
  model.evaluate(x, y, batch_size=B, verbose=0)
  _fit(model, second, epochs=1)
  train_seeds = [s for s in seeds]
  assert first == _replay(train_seeds[0], 12)
  assert second == _replay(train_seeds[-1], 6)
  assert _charged(model) == 18


def test_restore_from_backup_never_uncharges_a_step(seeds, tmp_path):
  """A fit interrupted after a BackupAndRestore backup, then resumed in a new model from the
  backup: the resumed fit draws from a new generator (no sample reused), and the ledger
  holds every step taken, those after the backup before the interruption included."""
  backup = os.path.join(tmp_path, "backup")
  model, first = _model(), []
  with pytest.raises(KeyboardInterrupt):
    _fit(model, first, epochs=3, callbacks=[
        keras.callbacks.BackupAndRestore(backup, save_freq=5), _RaiseAt(8)])
  assert first == _replay(seeds[0], 8)
  resumed, second = _model(), []
  _fit(resumed, second, epochs=3, callbacks=[keras.callbacks.BackupAndRestore(backup,
                                                                              save_freq=5)])
  assert second == _replay(seeds[-1], len(second))
  restored_iterations = int(resumed.optimizer.iterations.numpy()) - len(second)
  assert 0 < restored_iterations < 8
  assert _charged(resumed) >= 8 + len(second)     # the steps after the backup stay charged
