"""Tests of tf_dpiter.keras (the folder mirrors the package)."""
