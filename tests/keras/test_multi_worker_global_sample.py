"""Under several workers fit takes only a distributed dataset of one global sample.

Claim: one Poisson(q) sample per global step, add/remove one example, sensitivity S. Review R
(session 33) ran fit(x, y, batch_size=B) on arrays with 2 workers (MultiWorkerMirroredStrategy,
noise off, the real step): every worker drew its own Poisson sample of all n records and Keras
joined their rows, so 32 (record, step) pairs entered one step's sum twice in 100 steps (2 S
where the ledger states S). The refusal runs before any collective or step, so it is tested
here in one process with the worker count stubbed to 2; the accepted path is
tests/keras/test_multi_worker.py (2 and 3 real workers on dp.data.distributed_poisson_batches).
"""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter.keras.model import multi_worker


class _Model(multi_worker.MultiWorkerFitMixin, dp.keras.DPSequential):
  pass


@pytest.fixture
def two_workers(monkeypatch):
  monkeypatch.setattr(multi_worker, "num_workers", lambda strategy: 2)


def _data():
  rng = np.random.default_rng(0)
  return rng.normal(size=(40, 3)).astype("float32"), rng.integers(0, 2, 40).astype("int32")


def _inputs():
  x, y = _data()
  return {"arrays": lambda: dict(x=x, y=y, batch_size=8),
          "one process's Poisson batches": lambda: dict(
              x=dp.data.poisson_batches(x, y, expected_batch_size=8))}


@pytest.mark.parametrize("kind", list(_inputs()))
def test_data_of_one_process_is_refused_under_several_workers(two_workers, kind):
  model = _Model([keras.Input((3,)), keras.layers.Dense(2)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  with pytest.raises(dp.errors.PrivacyConfigError, match="distributed_poisson_batches"):
    model.fit(epochs=1, verbose=0, **_inputs()[kind]())
  assert int(model.optimizer.iterations.numpy()) == 0
  assert int(model.ledger.sample_count.numpy()) == 0
