"""Tests of tf_dpiter.data (the folder mirrors the package)."""
