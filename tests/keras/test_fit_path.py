"""The fit path on arrays (issue 18): unpadded Poisson samples without XLA, padded with it,
and one ledger sample per step whatever steps_per_execution."""

import dp_accounting
import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.keras.model import fit_sampling

N, B = 240, 24


@pytest.fixture(name="data")
def _data():
  rng = np.random.RandomState(0)
  return rng.rand(N, 6).astype("float32"), rng.randint(0, 3, N).astype("int32")


@pytest.mark.parametrize("pad", [False, True])
def test_arrays_to_dataset_pads_only_when_asked(data, pad):
  x, y = data
  a = {"x": x, "y": y, "batch_size": B, "steps_per_epoch": 30}
  spec, _ = fit_sampling.arrays_to_dataset(a, dp.keras.DPKerasSGDOptimizer(1.0, 1.1), None,
                                           pad=pad)
  assert (spec.policy, spec.population_size, spec.sample_size) == ("poisson", N, B)
  size = dp.data.default_max_batch_size(N, B / N)
  sizes = []
  # fit keeps one endless iterator of samples for all its epochs: read one epoch
  for bx, by, w in a["x"].take(a["steps_per_epoch"]).as_numpy_iterator():
    m = int(w.sum())
    assert bx.shape[0] == by.shape[0] == w.shape[0] == (size if pad else max(m, 1))
    assert np.all(w[:m] == 1) and np.all(w[m:] == 0)
    sizes.append(m)
  assert len(sizes) == 30
  # sizes ~ Binomial(240, 0.1) (sd 4.6): 30 draws are not all equal
  assert len(set(sizes)) > 1


def test_steps_per_execution_records_every_step(data):
  # 4 steps per compiled call (spe 1 is every other fit test): still one sample per step
  x, y = data
  spe = 4
  z, steps, epochs = 1.25, 8, 2
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, z, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=spe)
  model.fit(x, y, batch_size=B, epochs=epochs, steps_per_epoch=steps, verbose=0)
  (run,) = model.ledger.to_dict()["runs"]
  assert run["count"] == epochs * steps == int(model.optimizer.iterations.numpy())
  assert (run["policy"], run["population_size"]) == ("poisson", N)
  assert run["selection_probability"] == pytest.approx(B / N, rel=1e-12)
  acc = dp_accounting.rdp.RdpAccountant()
  acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      B / N, dp_accounting.GaussianDpEvent(z)), epochs * steps))
  assert dp.accounting.epsilon(model.ledger, 1e-5) == pytest.approx(acc.get_epsilon(1e-5),
                                                                    rel=1e-9)
