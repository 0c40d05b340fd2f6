"""The DP step writes its ledger itself (LedgerSampling), and `optimizer.dp_query` is the step's
query wrapped so that it records with the same sampling in the same ledger."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tf_dpiter as dp
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L
from tf_dpiter.errors import ParameterTypeError

# Nightly (`-m slow`): the XLA case with the noise drawn inside the compiled program. [False]
# keeps one sample per train step, (population 64, q 1/8) and the query's own (S, z S) row by
# default; tests/keras/test_xla_noise_inside.py::test_compiled_and_plain_steps_write_the_same_
# ledger keeps the compiled step (jit_compile=True, compiled_noise=True, two single-step fits)
# writing one sample per step (2) whose sample and query rows are equal, bit for bit, to the
# plain step's after the same fits.
SLOW_CASES = {"test_one_ledger_sample_per_step_with_the_querys_own_event[True]"}


def _declared_optimizer(z=1.3, clip=0.7):
  opt = dp.keras.DPKerasSGDOptimizer(clip, z, learning_rate=0.1)
  opt.set_sampling(100, 0.08, "poisson", 8)
  return opt


def test_sampling_records_one_sample_with_its_declaration():
  sampling = L.LedgerSampling(200, 0.05, policy="shuffle", sample_size=10, examples_per_record=2)
  sampling.record((dq.GaussianSumEvent(1.0, 3.0),))
  samples, queries = sampling.ledger.get_arrays()
  np.testing.assert_allclose(samples[0, :3], [200.0, 0.05, 10.0])
  assert int(samples[0, 4]) == 2
  # columns clip, noise, sensitivity: replace-one with microbatches is charged 2 S
  np.testing.assert_allclose(queries[0, 2:5], [1.0, 3.0, 2.0])
  assert sampling.config() == {"population_size": 200.0, "selection_probability": 0.05,
                               "policy": "shuffle", "sample_size": 10.0,
                               "examples_per_record": 2}


def test_sharing_wrapper_records_in_the_same_ledger_with_the_same_variables():
  sampling = L.LedgerSampling(100, 0.1)
  query = dq.GaussianSumQuery(1.0, 2.0, seed=0)
  wrapped = L.QueryWithLedger.sharing(query, sampling)
  assert wrapped.ledger is sampling.ledger and wrapped.query is query
  wrapped.set_sampling(400, 0.25)   # seen by the sampling: one set of variables
  assert float(sampling.population_size) == 400.0
  g = wrapped.initial_global_state()
  state = wrapped.accumulate_records(wrapped.derive_sample_params(g),
                                     wrapped.initial_sample_state(tf.TensorSpec([2])),
                                     tf.ones([3, 2]))
  wrapped.get_noised_result(state, g)
  sampling.record((dq.GaussianSumEvent(1.0, 2.0),))
  samples, _ = sampling.ledger.get_arrays()
  assert samples.shape[0] == 2
  np.testing.assert_allclose(samples[:, :2], [[400.0, 0.25], [400.0, 0.25]])
  assert wrapped.get_config()["population_size"] == 400.0


def test_sharing_refuses_what_is_not_a_query_or_a_sampling():
  sampling = L.LedgerSampling(100, 0.1)
  with pytest.raises(ParameterTypeError, match="`query` must be"):
    L.QueryWithLedger.sharing(object(), sampling)
  with pytest.raises(ParameterTypeError, match="`sampling` must be"):
    L.QueryWithLedger.sharing(dq.GaussianSumQuery(1.0, 1.0), object())


def test_optimizer_dp_query_is_read_only_and_records_in_the_optimizers_ledger():
  opt = _declared_optimizer()
  query = opt.dp_query
  assert isinstance(query, L.QueryWithLedger)
  assert query is opt.dp_query   # made once per (query, sampling)
  assert query.query is opt.private_step.base_query
  assert query.ledger is opt.ledger and query.sampling is opt.private_step.sampling
  with pytest.raises(AttributeError):
    opt.dp_query = None
  with pytest.raises(AttributeError):
    opt.private_step.query = None
  g = query.initial_global_state()
  state = query.accumulate_records(query.derive_sample_params(g),
                                   query.initial_sample_state(tf.TensorSpec([2])),
                                   tf.ones([3, 2]))
  before = int(opt.ledger.sample_count)
  query.get_noised_result(state, g)
  assert int(opt.ledger.sample_count) == before + 1
  opt.set_sampling(300, 0.02, "poisson", 6)   # the same sampling object, re-declared
  assert float(query.population_size) == 300.0


@pytest.mark.parametrize("jit", [False, True])
def test_one_ledger_sample_per_step_with_the_querys_own_event(jit):
  """One train step appends exactly one sample whose Gaussian row is the query's (S, z S),
  also when the noise is drawn inside the compiled program (compiled_noise=True)."""
  keras.utils.set_random_seed(0)
  z, clip = 1.3, 0.7
  model = dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(2)])
  opt = dp.keras.DPKerasSGDOptimizer(clip, z, learning_rate=0.1)
  if jit:
    opt.private_step.set_flags(compiled_noise=True)
  model.compile(optimizer=opt, jit_compile=jit,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  opt.set_sampling(64, 8 / 64, "poisson", 8)
  rng = np.random.RandomState(0)
  x, y = rng.randn(8, 3).astype("float32"), rng.randint(0, 2, 8)
  for expected in (1, 2):
    model.train_on_batch(x, y)
    assert int(opt.ledger.sample_count) == expected
  samples, queries = opt.ledger.get_arrays()
  np.testing.assert_allclose(samples[:, :2], [[64.0, 0.125]] * 2)
  assert queries.shape[0] == 2
  np.testing.assert_allclose(queries[:, 2:4], [[clip, z * clip]] * 2, rtol=1e-6)
