"""The sampling policies' codes in the ledger's rows are stable fields of their classes.

Checkpoints store a sample's policy as a number; the number was once the policy's position in
a list, so a policy added in the middle would have renumbered stored ledgers. The table below
is the literal code -> name mapping stored ledgers use: a renumbering fails here.
"""

import numpy as np
import pytest

from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import ledger_file
from tf_dpiter.ledger import policies
from tf_dpiter.ledger import policy_base
from tf_dpiter.ledger import records
from tf_dpiter.ledger import schema

# code -> name, as stored in every ledger written so far (the former list positions).
STORED_CODES = {
    0: "poisson",
    1: "fixed_size",
    2: "shuffle",
    3: "full",
    4: "cyclic_poisson",
    5: "truncated_poisson",
    6: "user_poisson",
    7: "balls_in_bins",
    8: "repeat_and_select",
    9: "client_poisson",
    10: "client_fixed_size",
}


def test_every_code_is_pinned_and_is_a_class_attribute():
  registered = {policies.get(name).code: name for name in policies.names()}
  registered[schema.REPEAT_AND_SELECT_CODE] = schema.REPEAT_AND_SELECT
  assert registered == STORED_CODES
  for code, name in STORED_CODES.items():
    assert records.policy_code(name) == code
    assert records.policy_name(code) == name
    assert records.policy_name(float(code)) == name
  # the code, relation and unit are fields of the class, not looked up in a table
  for name in policies.names():
    cls = type(policies.get(name))
    assert "code" in vars(cls) and cls.code == records.policy_code(name)
    assert cls.relation in schema.RELATIONS and cls.unit in schema.UNITS
  assert policies.UserPoisson.unit == "user" and policies.Poisson.unit == "example"
  assert policies.ClientPoisson.unit == policies.ClientFixedSize.unit == "client"
  assert policies.Shuffle.relation == schema.REPLACE_ONE


def test_rows_stored_with_the_former_positions_read_as_before():
  # one row of each policy as a checkpoint of the former layout stored it: code = position
  rows, queries = [], []
  for code, name in STORED_CODES.items():
    if name == schema.REPEAT_AND_SELECT:
      continue
    policy = policies.get(name)
    k = 10.0
    q = 0.1 if name != schema.FULL else 1.0
    rows.append([1000.0, q, k, float(code), 1.0, 1.0])
    factor = records.sensitivity_factor(policy.relation)
    queries.append([len(rows) - 1, schema.GAUSSIAN, 1.0, 2.0, factor])
  samples, queries = records.validate_arrays(np.array(rows), np.array(queries))
  runs = records.to_records(records.run_length_encode(samples, queries))
  assert [r.policy for r in runs] == [n for n in STORED_CODES.values()
                                      if n != schema.REPEAT_AND_SELECT]
  assert [r.relation for r in runs] == [policies.get(r.policy).relation for r in runs]
  # and the file form (names) maps back to the same codes
  d = ledger_file.arrays_to_dict(samples, queries, passes=100)
  back, _ = ledger_file.dict_to_arrays(d)[:2]
  np.testing.assert_array_equal(back[:, 3], samples[:, 3])


def test_an_unknown_code_is_refused_naming_the_known_ones():
  rows = np.array([[1000.0, 0.1, 10.0, 11.0, 1.0, 0.0]])
  with pytest.raises(PrivacyConfigError, match=r"policy code must be one of .*'balls_in_bins'"):
    records.validate_arrays(rows, np.zeros([0, 5]))
  with pytest.raises(PrivacyConfigError, match=r"`code` must be a registered policy's code"):
    records.policy_name(11)


def test_a_policy_cannot_take_a_used_or_reserved_code():

  class Renumbered(policy_base.SamplingPolicy):
    name = "renumbered_poisson"
    code = 2       # shuffle's
    relation = schema.ADD_OR_REMOVE

  with pytest.raises(PrivacyConfigError, match=r"`code` of policy 'renumbered_poisson' must be "
                                               r"unused: 2 is policy 'shuffle'"):
    policies.register(Renumbered())
  Renumbered.code = schema.REPEAT_AND_SELECT_CODE
  with pytest.raises(PrivacyConfigError, match=r"selection marker"):
    policies.register(Renumbered())
  Renumbered.code = 1.5
  with pytest.raises(PrivacyConfigError, match=r"`code` .* must be an int"):
    policies.register(Renumbered())
  with pytest.raises(PrivacyConfigError, match=r"`name` must be a policy name not registered"):
    policies.register(policies.Poisson())
  assert "renumbered_poisson" not in policies.names()
