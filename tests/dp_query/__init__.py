"""Tests of tf_dpiter.dp_query (the folder mirrors the package)."""
