"""Tests of tf_dpiter.ledger (the folder mirrors the package)."""
