"""Tests of tf_dpiter.draw_discard (the folder mirrors the package)."""
