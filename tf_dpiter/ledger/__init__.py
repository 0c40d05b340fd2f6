"""The privacy ledger (McMahan et al. 2018, Section 6): sampling and sum-query events in TF variables.

Public names: `PrivacyLedger` (the ledger), `LedgerSampling` (the declared sampling that
records one sample per noised result), `QueryWithLedger` (a DPQuery wrapper recording every
sample with one), `LedgerJournal` (crash-safe append-only journal); the sampling policies
(`POLICIES`: `POISSON`, `FIXED_SIZE`, `SHUFFLE`, `FULL`) and neighbouring relations
(`RELATIONS`: `ADD_OR_REMOVE`, `REPLACE_ONE`) with `relation_for_policy` and
`sensitivity_factor`; `USER_POISSON` and `BALLS_IN_BINS` (add or remove one); the
record types `QueryRecord`, `SampleRun` and `run_length_encode`. A private hyperparameter
selection is recorded by `selection` (written by `tf_dpiter.tuning`).

`records` and `ledger_file` (the record types, the checks and the JSON format) import no
TensorFlow; `PrivacyLedger`, `LedgerSampling`, `QueryWithLedger` and `LedgerJournal` load on
first use.
"""

import importlib

from tf_dpiter.ledger.records import ADD_OR_REMOVE
from tf_dpiter.ledger.records import BALLS_IN_BINS
from tf_dpiter.ledger.records import FIXED_SIZE
from tf_dpiter.ledger.records import FULL
from tf_dpiter.ledger.records import POISSON
from tf_dpiter.ledger.records import POLICIES
from tf_dpiter.ledger.records import RELATIONS
from tf_dpiter.ledger.records import REPLACE_ONE
from tf_dpiter.ledger.records import SHUFFLE
from tf_dpiter.ledger.records import USER_POISSON
from tf_dpiter.ledger.records import QueryRecord
from tf_dpiter.ledger.records import SampleRun
from tf_dpiter.ledger.records import relation_for_policy
from tf_dpiter.ledger.records import run_length_encode
from tf_dpiter.ledger.records import sensitivity_factor

_LAZY = {
    "PrivacyLedger": "tf_dpiter.ledger.privacy_ledger",
    "LedgerSampling": "tf_dpiter.ledger.privacy_ledger",
    "QueryWithLedger": "tf_dpiter.ledger.query_with_ledger",
    "LedgerJournal": "tf_dpiter.ledger.journal",
}

__all__ = sorted(list(_LAZY) + [
    "ADD_OR_REMOVE", "BALLS_IN_BINS", "FIXED_SIZE", "FULL", "POISSON", "POLICIES", "RELATIONS", "REPLACE_ONE",
    "SHUFFLE", "USER_POISSON", "QueryRecord", "SampleRun", "relation_for_policy", "run_length_encode",
    "sensitivity_factor"])


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'tf_dpiter.ledger' has no attribute {name!r}")


def __dir__():
  return list(__all__)
