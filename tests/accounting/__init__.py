"""Tests of tf_dpiter.accounting (the folder mirrors the package)."""
