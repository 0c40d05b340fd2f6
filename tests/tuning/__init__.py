"""Tests of tf_dpiter.tuning (the folder mirrors the package)."""
