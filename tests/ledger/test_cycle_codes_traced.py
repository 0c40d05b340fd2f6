"""The ledger's cycle position when a cyclic policy is registered after a write was traced.

The cycle position counts the samples of policies whose samples advance it (cyclic Poisson:
`SamplingPolicy.advances_cycle`); the data schedule reads it to pick the next group, and the
accounting of cyclic Poisson sampling assumes that schedule. The registry of policies is a
Python fact read when a write is traced; a train function traced before a policy was
registered keeps running afterwards. Here a rollback (a checkpoint of an earlier step
restored) makes that old trace rewrite one of the ledger's two sets of rows, the result is
saved and restored into a new ledger: its cycle position must still count every cyclic
sample.
"""

import os

import tensorflow as tf

from tf_dpiter import dp_query as dq
from tf_dpiter.ledger import PrivacyLedger
from tf_dpiter.ledger import policies
from tf_dpiter.ledger import policy_base
from tf_dpiter.ledger import schema

NAME, CODE = "late_cyclic_test", 101


class LateCyclic(policy_base.SamplingPolicy):
  """A cyclic policy registered by the test (add or remove one example)."""
  name = NAME
  code = CODE
  relation = schema.ADD_OR_REMOVE
  advances_cycle = True


def _events():
  return (dq.GaussianSumEvent(1.0, 1.0),)


def test_a_cyclic_policy_registered_after_the_write_was_traced_keeps_the_cycle(tmp_path):
  ledger = PrivacyLedger()
  poisson_step = tf.function(lambda: ledger.record_sample(1000.0, 0.05, _events()))
  poisson_step()   # traced while the new policy is not registered
  policies.register(LateCyclic())
  try:
    early = tf.train.Checkpoint(ledger=ledger).save(os.path.join(tmp_path, "early"))
    for _ in range(3):
      ledger.record_sample(1000.0, 0.05, _events(), policy=NAME)
    assert int(ledger.cycle_position) == 3
    # roll back to the early checkpoint: the next write (the old trace) reconciles the sets
    tf.train.Checkpoint(ledger=ledger).restore(early)
    poisson_step()
    assert int(ledger.cycle_position) == 3
    late = tf.train.Checkpoint(ledger=ledger).save(os.path.join(tmp_path, "late"))
    resumed = PrivacyLedger()
    tf.train.Checkpoint(ledger=resumed).restore(late)
    assert int(resumed.cycle_position) == 3
    resumed.record_sample(1000.0, 0.05, _events(), policy=NAME)
    assert int(resumed.cycle_position) == 4
  finally:
    policies.unregister(NAME)


def test_unregister_and_register_between_two_writes_keep_the_cycle():
  """The eager write after the registry changed counts the new policy (its own trace)."""
  ledger = PrivacyLedger()
  ledger.record_sample(1000.0, 0.05, _events())
  policies.register(LateCyclic())
  try:
    ledger.record_sample(1000.0, 0.05, _events(), policy=NAME)
    ledger.record_sample(1000.0, 0.05, _events(), policy=NAME)
  finally:
    policies.unregister(NAME)
  ledger.record_sample(1000.0, 0.05, _events())
  assert int(ledger.cycle_position) == 2
