"""A ledger file forged without a key: documented as accepted, refused when a key is used.

Rule: the reported epsilon is read from the ledger file, so a file whose step count was
lowered reports a smaller epsilon than the run spent. An unkeyed file carries only a SHA-256
digest, which anyone can recompute: it detects accidents, not forgery, and the report says
so. A file saved with an HMAC key is refused by `load_json` / `privacy_report` once altered,
with its digest recomputed or not. The ledger here is that of a real Poisson fit (add/remove
one example, q = B / n); the forgery drops its count from 10 to 1.
"""

import json
import os

import keras
import numpy as np
import pytest

import tf_dpiter as dp
from tf_dpiter import accounting
from tests.ledger import forgery

N, BATCH, DELTA = 100, 10, 1e-5


def _fitted_ledger():
  keras.utils.set_random_seed(0)
  rng = np.random.RandomState(0)
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(rng.randn(N, 4).astype("float32"), rng.randint(0, 2, N), batch_size=BATCH,
            epochs=1, verbose=0)
  assert int(model.ledger.sample_count) == N // BATCH
  return model.ledger


def test_unkeyed_forgery_is_accepted_and_the_report_says_a_key_is_needed(tmp_path):
  ledger = _fitted_ledger()
  path = os.path.join(tmp_path, "ledger.json")
  ledger.save_json(path)
  forged = json.dumps(forgery.forge_count(json.load(open(path)), 1))
  report = accounting.privacy_report(forged, delta=DELTA)
  assert report.num_samples == 1 and report.epsilon < accounting.epsilon(ledger, DELTA)
  assert "NOT forgery" in str(report) and "key" in str(report)
  assert "detects accidents, not forgery" in type(ledger).save_json.__doc__


def test_keyed_forgery_is_refused(tmp_path):
  ledger = _fitted_ledger()
  path = os.path.join(tmp_path, "ledger.json")
  ledger.save_json(path, key="secret")
  text = open(path).read()
  assert accounting.privacy_report(text, delta=DELTA, key="secret").num_samples == N // BATCH
  forged = forgery.forge_count(json.loads(text), 1)                       # digest recomputed, no HMAC
  with pytest.raises(ValueError, match="hmac"):
    accounting.privacy_report(json.dumps(forged), delta=DELTA, key="secret")
  forged["hmac"] = json.loads(text)["hmac"]                  # the old HMAC kept
  forged_path = os.path.join(tmp_path, "forged.json")
  open(forged_path, "w").write(json.dumps(forged))
  with pytest.raises(ValueError, match="HMAC does not match"):
    type(ledger).load_json(forged_path, key="secret")
