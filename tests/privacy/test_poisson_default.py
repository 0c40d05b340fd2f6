"""TF Privacy's idiom `model.fit(x, y, batch_size=256)` is Poisson sampling, honestly
accounted (issue 11 item 4): q = 256 / n, round(n / 256) steps per epoch, policy "poisson".
On MNIST's n = 60000 with clip 1.0 and noise 1.1, 60 epochs give epsilon ~= 2.6 at 1e-5
(TF Privacy's tutorial value), not the 57 of shuffled accounting."""

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import accounting
from tf_dpiter.ledger import ledger_file

N, B = 60000, 256


def test_fit_batch_size_is_poisson_with_tf_privacy_epsilon():
  rng = np.random.RandomState(0)
  x, y = rng.randn(N, 4).astype("float32"), rng.randint(0, 10, N)
  keras.utils.set_random_seed(0)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(10)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(x, y, batch_size=B, epochs=1, verbose=0)
  d = model.ledger.to_dict()
  (run,) = d["runs"]
  assert run["count"] == round(N / B) == 234
  assert (run["policy"], run["relation"]) == ("poisson", "add_or_remove_one")
  assert run["selection_probability"] == pytest.approx(B / N, rel=1e-12)
  assert run["queries"][0]["sensitivity"] == 1.0
  run["count"] *= 60                        # the same steps for 60 epochs
  d["num_samples"] = run["count"]
  eps60 = accounting.epsilon(ledger_file.sign(d), 1e-5)
  assert 2.55 < eps60 < 2.65
  shuffled = accounting.compute_dp_sgd_privacy(N, B, 1.1, 60, 1e-5, sampling="shuffle").epsilon
  assert shuffled > 10 * eps60
