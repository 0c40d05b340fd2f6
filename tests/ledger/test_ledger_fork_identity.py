"""A checkpoint restored into a new PrivacyLedger: its next samples are the new object's run
(review R4, session 35). Before, a write inside tf.function right after the restore
continued under the checkpoint's own run identity (the stored table, "own" included, copied
onto the mirror). Two such restores of one checkpoint are
two ledger objects appending under ONE identity, which run_ids' merge assumes never happens
("one identity is written by one ledger object, which only appends"): with equal rows the
merge keeps the longer view and drops a branch.

Relation/unit: add/remove one example (Poisson, q = 0.1, z = 1), as each row records.
Case: ledger A 4 graph writes, checkpoint; two fresh ledgers restore it and make 3 graph
writes each; a third ledger merges both. Steps that touched the two branches: 4 + 3 + 3 = 10.
Measured before the fix: both branches' table ((id_A, 7, 0),), merged 7 samples (not 10).
Now an eager write or read after the restore continues under the new object's identity, and a
first write inside tf.function is refused with the remedy (reconcile eagerly).
(Keras' fit and custom loop read the ledger eagerly first, which re-identifies the branch:
ensembles of two restored towers are charged 22 of 22 there.)
"""

import os

import pytest
import tensorflow as tf

from tf_dpiter import dp_query as dq
from tf_dpiter import ledger as L


def _graph_writer(led):
  return tf.function(lambda: led.record_sample(100.0, 0.1, (dq.GaussianSumEvent(1.0, 1.0),)))



def _checkpoint_of_four_samples(tmp_path):
  a = L.PrivacyLedger()
  write = _graph_writer(a)
  for _ in range(4):
    write()
  return a, tf.train.Checkpoint(ledger=a).save(os.path.join(str(tmp_path), "a"))


@pytest.mark.parametrize("first", ["reconcile", "eager_write", "eager_read"])
def test_two_branches_restored_from_one_checkpoint_are_both_charged(tmp_path, first):
  a, path = _checkpoint_of_four_samples(tmp_path)
  branches = []
  for _ in range(2):
    b = L.PrivacyLedger()
    tf.train.Checkpoint(ledger=b).restore(path)
    writes = 3
    if first == "reconcile":
      b.reconcile()
    elif first == "eager_write":
      b.record_sample(100.0, 0.1, (dq.GaussianSumEvent(1.0, 1.0),))
      writes = 2
    else:
      assert int(b.sample_count) == 4
    write_b = _graph_writer(b)
    for _ in range(writes):
      write_b()
    assert b.run_table() == ((a.run_id, 4, 0), (b.run_id, 3, 0))
    branches.append(b)
  merged = L.PrivacyLedger()
  for b in branches:
    merged.merge_arrays(*b.state())
  assert int(merged.sample_count) == 10, (int(merged.sample_count), merged.run_table())


def test_a_graph_write_right_after_a_restore_into_a_new_ledger_is_refused(tmp_path):
  _, path = _checkpoint_of_four_samples(tmp_path)
  b = L.PrivacyLedger()
  tf.train.Checkpoint(ledger=b).restore(path)
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"ledger\.reconcile\(\) eagerly"):
    _graph_writer(b)()
  b.reconcile()          # the remedy the message names
  _graph_writer(b)()
  assert int(b.sample_count) == 5 and b.run_table()[-1] == (b.run_id, 1, 0)
