"""No restore rolls a PrivacyLedger back (the ledger alone, no Keras).

A checkpoint restore assigns the ledger's checkpointed rows; the mirror of what the object
recorded (in no checkpoint) brings them back before the next write or eager read, so a
rollback keeps the abandoned branch charged. Another run's ledger restored into one that
recorded steps is merged by `reconcile()` (restored rows, then this ledger's own after the
common prefix) and refused by a write in a graph until then. A SavedModel holds the ledger.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_dpiter as dp
from tf_dpiter import dp_query


def _record(ledger, steps, stddev=1.0):
  event = dp_query.GaussianSumEvent(1.0, stddev)
  for _ in range(steps):
    ledger.record_sample(100, 0.1, (event,))


def test_a_restore_of_an_earlier_step_keeps_every_recorded_sample(tmp_path):
  ledger = dp.ledger.PrivacyLedger()
  _record(ledger, 2)
  ckpt = tf.train.Checkpoint(ledger=ledger)
  saved = ckpt.save(str(tmp_path / "ck"))
  _record(ledger, 3)
  ckpt.restore(saved)
  assert int(ledger.sample_count.numpy()) == 5           # eager read: reconciled
  assert ledger.get_arrays()[0].shape[0] == 5
  ckpt.restore(saved)
  tf.function(lambda: _record(ledger, 1))()               # a write in a graph reconciles first
  assert int(ledger.sample_count.numpy()) == 6


def test_a_restore_into_a_new_ledger_adopts_the_checkpoint(tmp_path):
  ledger = dp.ledger.PrivacyLedger()
  _record(ledger, 4)
  ledger.record_passes(2)
  saved = tf.train.Checkpoint(ledger=ledger).save(str(tmp_path / "ck"))
  fresh = dp.ledger.PrivacyLedger()
  tf.train.Checkpoint(ledger=fresh).restore(saved).assert_consumed()
  _record(fresh, 1)
  assert int(fresh.sample_count.numpy()) == 5 and int(fresh.passes.numpy()) == 2


def test_another_runs_checkpoint_is_refused_in_a_graph_and_merged_eagerly(tmp_path):
  other = dp.ledger.PrivacyLedger()
  _record(other, 3, stddev=5.0)
  saved = tf.train.Checkpoint(ledger=other).save(str(tmp_path / "ck"))
  ledger = dp.ledger.PrivacyLedger()
  _record(ledger, 2)
  tf.train.Checkpoint(ledger=ledger).restore(saved)
  with pytest.raises(tf.errors.InvalidArgumentError, match="another run"):
    tf.function(lambda: _record(ledger, 1))()
  ledger.reconcile()
  samples, queries = ledger.get_arrays()
  assert samples.shape[0] == 5                             # 3 restored + this ledger's 2
  np.testing.assert_array_equal(queries[:, 3], [5.0, 5.0, 5.0, 1.0, 1.0])
  np.testing.assert_array_equal(queries[:, 0], np.arange(5))


def test_a_savedmodel_of_a_trained_dp_model_saves_and_loads(tmp_path):
  import keras  # pylint: disable=g-import-not-at-top
  model = dp.keras.DPSequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(dp.keras.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1), "mse")
  x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
  model.fit(x, x[:, :2], batch_size=8, verbose=0)
  tf.saved_model.save(model, str(tmp_path / "sm"))
  loaded = tf.saved_model.load(str(tmp_path / "sm"))
  assert loaded is not None


def _cyclic_step(ledger):
  ledger.record_sample(24.0, 1.0, (dp_query.GaussianSumEvent(1.0, 0.0),),
                       policy="cyclic_poisson", sample_size=4.0)


def test_reading_the_cycle_position_writes_nothing_even_halfway_through_a_write(tmp_path):
  """The dataset's generator reads `cycle_position` on a tf.data thread, possibly between a
  step's write to the mirror and its write to the checkpointed set: that read must not
  reconcile (an eager rewrite of both sets under the running step)."""
  ledger = dp.ledger.PrivacyLedger(initial_capacity=8)
  for _ in range(3):
    _cyclic_step(ledger)
  v, mirror = ledger._v, ledger._mirror   # pylint: disable=protected-access
  # the state halfway through a step: the mirror written, the checkpointed set not yet
  mirror.cycle_position.assign_add(1)
  mirror.sample_count.assign_add(1)
  before = [t.numpy().copy() for t in (v.samples, v.queries, v.sample_count, v.cycle_position)]
  assert int(ledger.cycle_position.numpy()) == 4   # the larger set's: includes the running step
  after = [t.numpy() for t in (v.samples, v.queries, v.sample_count, v.cycle_position)]
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, b)
  assert mirror.samples.numpy().shape[0] == 8      # not shrunk by a rewrite either


def test_a_thread_reading_the_cycle_position_during_steps_leaves_the_rows_whole():
  """The race the generator's read made: 300 graph steps writing the ledger while another
  thread reads `cycle_position` in a loop; the rows stay one query per sample, in order."""
  import threading   # pylint: disable=import-outside-toplevel
  ledger = dp.ledger.PrivacyLedger(initial_capacity=8)
  step = tf.function(lambda: _cyclic_step(ledger))
  stop, reads = threading.Event(), []

  def reader():
    while not stop.is_set():
      reads.append(int(ledger.cycle_position.numpy()))

  thread = threading.Thread(target=reader)
  thread.start()
  try:
    for _ in range(300):
      step()
  finally:
    stop.set()
    thread.join()
  samples, queries = ledger.get_arrays()
  assert samples.shape[0] == queries.shape[0] == 300
  np.testing.assert_array_equal(queries[:, 0], np.arange(300))
  assert int(ledger.cycle_position.numpy()) == 300
  assert len(reads) > 100 and reads == sorted(reads)   # the reads ran beside the steps
