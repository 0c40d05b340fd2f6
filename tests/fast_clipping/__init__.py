"""Tests of tf_dpiter.keras.fast_clipping."""
