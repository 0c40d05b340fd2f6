"""Run identities of the ledger (`ledger.run_ids`): a merge charges one run's steps once and
two runs' steps twice, even when the two runs' rows are equal (review R3, finding 5).

Relation: add/remove one example (Poisson sampling), unit = example, as each row records.
Epsilon is compared with dp-accounting's RDP accountant called by hand on the steps that
touched the released weights.
"""

import json
import os
import warnings

import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.ledger import ledger_file
from tf_dpiter.ledger import privacy_ledger
from tf_dpiter.ledger import run_ids

DELTA = 1e-5


def _by_hand(steps, q=0.1, z=1.0):
  """Epsilon at DELTA of `steps` Poisson-sampled Gaussian steps (dp-accounting RDP)."""
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
  return acc.get_epsilon(DELTA)


def _steps(led, count, z=1.0):
  for _ in range(count):
    led.record_sample(100.0, 0.1, (dq.GaussianSumEvent(1.0, z),))


def test_each_ledger_has_its_own_128_bit_identity():
  a, b = L.PrivacyLedger(), L.PrivacyLedger()
  assert len(a.run_id) == 32 and int(a.run_id, 16) >= 0
  assert a.run_id != b.run_id


def test_two_equal_runs_are_both_charged_and_a_run_seen_twice_once():
  """Two ledgers of one recipe (10 and 5 steps, q = 0.1, z = 1): merged 15 samples, epsilon
  = 15 steps by hand; merging either again adds nothing."""
  a, b = L.PrivacyLedger(), L.PrivacyLedger()
  _steps(a, 10)
  _steps(b, 5)
  c = L.PrivacyLedger()
  for _ in range(2):
    c.merge_arrays(*a.state())
    c.merge_arrays(*b.state())
  assert int(c.sample_count) == 15
  assert dp.accounting.epsilon(c, DELTA) == pytest.approx(_by_hand(15), rel=1e-9)
  _steps(a, 3)   # the same run continued: its longer view replaces the shorter one
  c.merge_arrays(*a.state())
  assert int(c.sample_count) == 18


def test_merged_arrays_keeps_the_longer_view_of_one_identity_and_adds_passes_of_two():
  a = L.PrivacyLedger()
  _steps(a, 4)
  a.record_passes(1)
  early = a.state()
  _steps(a, 2)
  late = a.state()
  s, _, passes, _, table = privacy_ledger.merged_arrays(late, early)
  assert s.shape[0] == 6 and passes == 1 and table == ((a.run_id, 6, 1),)
  b = L.PrivacyLedger()
  _steps(b, 4)
  b.record_passes(1)
  s, _, passes, _, table = privacy_ledger.merged_arrays(b.state(), early)
  assert s.shape[0] == 8 and passes == 2
  assert [t[0] for t in table] == [a.run_id, b.run_id]


def test_a_ledger_without_identity_is_another_run():
  """Arrays without a run table (an earlier version's) are charged in full, even when equal to
  rows already held: the safe side."""
  a = L.PrivacyLedger()
  _steps(a, 3)
  samples, queries, passes = a.state()[:3]
  a.merge_arrays(samples, queries, passes)
  assert int(a.sample_count) == 6


def test_the_identity_travels_in_the_signed_dict_and_a_continuation_keeps_it(tmp_path):
  a = L.PrivacyLedger()
  _steps(a, 4)
  d = a.to_dict()
  assert d[run_ids.FIELD][0] == [a.run_id, 4, 0]
  path = os.path.join(tmp_path, "l.json")
  a.save_json(path, key="k")
  b = L.PrivacyLedger.load_json(path, key="k")
  _steps(b, 2)   # a continuation of the saved run in another ledger object
  a.merge_arrays(*b.state())
  assert int(a.sample_count) == 6   # the 4 shared steps once, b's 2 added
  d["run_ids"] = [[a.run_id, 3, 0]]
  with pytest.raises(ParameterValueError):
    L.PrivacyLedger.from_dict(ledger_file.sign(d))


def test_an_older_dict_without_identity_is_read_as_one_run_of_its_own():
  a = L.PrivacyLedger()
  _steps(a, 3)
  d = a.to_dict()
  del d[run_ids.FIELD]
  old = L.PrivacyLedger.from_dict(ledger_file.sign(d))
  a.merge_arrays(*old.state())
  assert int(a.sample_count) == 6
  a.merge_arrays(*old.state())   # the same copy again: once
  assert int(a.sample_count) == 6


def test_checkpoint_restore_of_the_same_run_never_uncharges_and_another_run_adds(tmp_path):
  """A restore of this run's earlier checkpoint is a continuation (graph write); one of
  another run with equal rows is added (eager reconcile), never taken as a prefix."""
  a = L.PrivacyLedger()
  write = tf.function(lambda: a.record_sample(100.0, 0.1, (dq.GaussianSumEvent(1.0, 1.0),)))
  for _ in range(3):
    write()
  ckpt = tf.train.Checkpoint(ledger=a)
  path = ckpt.save(os.path.join(tmp_path, "a"))
  write()
  ckpt.restore(path)
  write()
  assert int(a.sample_count) == 5 and a.run_table() == ((a.run_id, 5, 0),)
  other = L.PrivacyLedger()
  _steps(other, 3)
  path = tf.train.Checkpoint(ledger=other).save(os.path.join(tmp_path, "o"))
  ckpt.restore(path)
  assert int(a.sample_count) == 8
  ids = {t[0] for t in a.run_table() if t[1]}
  assert ids == {a.run_id, other.run_id}


def test_two_dp_towers_nested_in_one_model_are_both_charged():
  """Review R3-5. Two towers DPSequential(Dense(8)), each 10 Poisson steps (q = 0.1, z = 1,
  S = 1) on the same n = 100 examples, nested side by side in one DPModel trained 2 steps:
  22 noised steps touched the released weights (before: 12 charged, 3.619 vs 4.359)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(100, 4)).astype(np.float32)
  y = rng.normal(size=(100, 1)).astype(np.float32)
  keras.utils.set_random_seed(0)

  def tower(name):
    model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(8)], name=name)
    model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
    model.fit(x, np.zeros((100, 8), np.float32), batch_size=10, epochs=1, verbose=0)
    assert int(model.ledger.sample_count.numpy()) == 10
    return model

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    a, b = tower("tower_a"), tower("tower_b")
    inp = keras.Input((4,))
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([a(inp), b(inp)]))
    model = dp.keras.DPModel(inp, out)
    model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
    model.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=2, verbose=0)
  assert int(model.ledger.sample_count.numpy()) == 22
  assert dp.accounting.epsilon(model.ledger, DELTA) == pytest.approx(_by_hand(22), rel=1e-9)
  table = json.loads(json.dumps(model.ledger.to_dict()[run_ids.FIELD]))
  assert sum(n for _, n, _ in table) == 22 and len({i for i, n, _ in table if n}) == 3
