"""dp.data.declare_shuffled: a user's own shuffled tf.data pipeline counts its passes itself,
so fit charges one un-amplified mechanism per pass (replace one, sensitivity 2C), and the
run's epsilon equals dp-accounting composed by hand for those passes."""

import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import PrivacyConfigError

N, B, Z, DELTA = 40, 10, 1.1, 1e-3


def _pipeline(drop_remainder=False, batch=B):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((N, 3)).astype("float32")
  y = rng.integers(0, 2, N)
  return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(
      batch, drop_remainder=drop_remainder)


def _model():
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, Z, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _shuffle_epsilon(passes):
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(Z / 2), passes))
  return acc.get_epsilon(DELTA)


def test_fit_charges_one_pass_per_epoch():
  ds = dp.data.declare_shuffled(_pipeline(), population_size=N, batch_size=B)
  spec = dp.data.get_sampling_spec(ds)
  assert (spec.policy, spec.population_size, spec.selection_probability) == ("shuffle", N,
                                                                             B / N)
  model = _model()
  model.fit(ds, epochs=3, verbose=0)
  assert int(model.ledger.passes.numpy()) == 3
  assert int(model.ledger.sample_count.numpy()) == 3 * (N // B)
  eps = model.privacy_statement(DELTA).epsilon
  assert eps == pytest.approx(_shuffle_epsilon(3), rel=1e-6)
  # declared by hand without record_passes, every step is charged as its own pass
  assert _shuffle_epsilon(3 * (N // B)) > 1.5 * eps


def test_a_repeated_pipeline_starts_a_pass_every_steps_per_pass_batches():
  ds = dp.data.declare_shuffled(_pipeline().repeat(), population_size=N, batch_size=B)
  model = _model()
  model.fit(ds, epochs=1, steps_per_epoch=10, verbose=0)   # 2.5 passes: 3 started
  assert int(model.ledger.passes.numpy()) == 3


def test_elements_are_unchanged():
  ds = dp.data.declare_shuffled(_pipeline(), N, B)
  assert ds.element_spec == _pipeline().element_spec
  assert sum(int(b[0].shape[0]) for b in ds) == N


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(population_size=0, batch_size=B), PrivacyConfigError, r"population_size=0"),
    (dict(population_size=N, batch_size=N + 1), PrivacyConfigError, r"batch_size=41"),
    (dict(population_size=N, batch_size=2.5), ParameterTypeError, r"batch_size=2.5"),
    (dict(population_size=N, batch_size=B, steps_per_pass=0), PrivacyConfigError,
     r"steps_per_pass=0"),
])
def test_bad_declarations_are_refused_naming_the_parameter(kwargs, error, match):
  with pytest.raises(error, match=match):
    dp.data.declare_shuffled(_pipeline(), **kwargs)


def test_batches_larger_than_declared_are_refused():
  with pytest.raises(PrivacyConfigError, match=r"hold 20 records.*batch_size=10"):
    dp.data.declare_shuffled(_pipeline(drop_remainder=True, batch=20), N, B)


def test_not_a_dataset_and_already_declared_are_refused():
  with pytest.raises(ParameterTypeError, match=r"dataset=\[1, 2\]"):
    dp.data.declare_shuffled([1, 2], N, B)
  x = np.zeros((N, 3), "float32")
  with pytest.raises(ValueError, match="already carries a sampling declaration"):
    dp.data.declare_shuffled(dp.data.shuffled_batches(x, batch_size=B), N, B)
