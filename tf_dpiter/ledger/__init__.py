"""The privacy ledger (McMahan et al. 2018, Section 6): sampling and sum-query events in TF variables.

`PrivacyLedger` holds the rows, `LedgerSampling` declares the sampling of the following
samples, `QueryWithLedger` wraps a DPQuery to record each of its samples, and
`LedgerJournal` is a crash-safe append-only journal; the sampling policies and their
neighbouring relations are in `records` and `policies`. A private hyperparameter selection
is recorded by `selection` (written by `tf_dpiter.tuning`).

`records` and `ledger_file` (the record types, the checks and the JSON format) import no
TensorFlow; `PrivacyLedger`, `LedgerSampling`, `QueryWithLedger` and `LedgerJournal` load on
first use.
"""

import importlib

from tf_dpiter.ledger.records import (
    ADD_OR_REMOVE, BALLS_IN_BINS, CLIENT_FIXED_SIZE, CLIENT_POISSON, FIXED_SIZE, FULL, POISSON,
    POLICIES, RELATIONS, REPLACE_ONE, SHUFFLE, USER_POISSON, QueryRecord, SampleRun,
    relation_for_policy, run_length_encode, sensitivity_factor)

_LAZY = {
    "PrivacyLedger": "tf_dpiter.ledger.privacy_ledger",
    "LedgerSampling": "tf_dpiter.ledger.privacy_ledger",
    "QueryWithLedger": "tf_dpiter.ledger.query_with_ledger",
    "LedgerJournal": "tf_dpiter.ledger.journal",
}

__all__ = sorted(list(_LAZY) + [
    "ADD_OR_REMOVE", "BALLS_IN_BINS", "CLIENT_FIXED_SIZE", "CLIENT_POISSON", "FIXED_SIZE", "FULL",
    "POISSON", "POLICIES", "RELATIONS", "REPLACE_ONE",
    "SHUFFLE", "USER_POISSON", "QueryRecord", "SampleRun", "relation_for_policy", "run_length_encode",
    "sensitivity_factor"])


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'tf_dpiter.ledger' has no attribute {name!r}")


def __dir__():
  return list(__all__)
