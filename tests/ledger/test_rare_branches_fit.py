"""The ledger's rare branches (`privacy_ledger._grow_call`, `_fix_call`, calls of functions
marked `_noinline`) in the real fit step compiled with jit_compile=True and
steps_per_execution > 1: the buffers grow past a capacity of 2 rows several times within one
execution, a checkpoint restore lowers the checkpointed set, and the next execution repairs
it before writing. The ledger never loses nor rolls back a row (every released step is
charged), and two models in one process each keep their own rows."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter.ledger import privacy_ledger

_N, _B, _STEPS = 48, 8, 6   # 6 steps: 2 executions of 3


def _model(jit=True):
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1)
  model.compile(opt, keras.losses.MeanSquaredError(), jit_compile=jit, steps_per_execution=3)
  return model, opt


def _fit(model, epochs=1):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(_N, 4)).astype("float32")
  y = rng.normal(size=(_N, 2)).astype("float32")
  model.fit(x, y, batch_size=_B, epochs=epochs, steps_per_epoch=_STEPS, verbose=0)


def _rows(opt):
  samples, queries = opt.ledger.get_arrays()
  return samples, queries


@pytest.mark.parametrize("jit", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_growth_and_repair_under_xla_and_steps_per_execution(jit, monkeypatch, tmp_path):
  # every ledger starts with room for 2 rows (the default is 1024)
  monkeypatch.setattr(privacy_ledger.PrivacyLedger.__init__, "__defaults__",
                      (2, "privacy_ledger"))
  model, opt = _model(jit)
  other, other_opt = _model(jit)
  assert int(tf.shape(opt.ledger._v.samples)[0]) == 2   # pylint: disable=protected-access
  _fit(model)
  ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
  saved = ckpt.save(str(tmp_path / "ck"))
  _fit(other, epochs=2)   # a second model sharing the process's rare-branch functions
  _fit(model, epochs=2)
  assert int(opt.ledger.sample_count.numpy()) == 3 * _STEPS   # grew 2 -> 4 -> 8 -> 16 -> 32
  assert int(tf.shape(opt.ledger._v.samples)[0]) >= 3 * _STEPS   # pylint: disable=protected-access
  before, _ = _rows(opt)
  ckpt.restore(saved)
  assert int(opt.iterations.numpy()) == _STEPS
  _fit(model)   # repaired (the mirror's 18 rows kept), then 6 more written
  samples, queries = _rows(opt)
  assert int(opt.ledger.sample_count.numpy()) == 4 * _STEPS
  assert int(opt.iterations.numpy()) == 2 * _STEPS
  assert samples.shape[0] == 4 * _STEPS
  np.testing.assert_array_equal(samples[:3 * _STEPS], before)   # no row lost or rewritten
  np.testing.assert_array_equal(queries[:, 0], np.arange(queries.shape[0]))
  assert int(other_opt.ledger.sample_count.numpy()) == 2 * _STEPS
  eps = dp.accounting.epsilon(opt.ledger, 1e-5, accountant="rdp")
  want = dp.accounting.compute_dp_sgd_privacy(_N, _B, 1.1, 4 * _STEPS * _B / _N, 1e-5).epsilon
  assert eps == pytest.approx(want, rel=1e-6)
