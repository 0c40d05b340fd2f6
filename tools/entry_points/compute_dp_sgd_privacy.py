"""Bazel entry point of the console script `compute_dp_sgd_privacy` (pyproject.toml: tf_dpiter.accounting.cli:compute_dp_sgd_privacy_main)."""

import sys

from tf_dpiter.accounting.cli import compute_dp_sgd_privacy_main

if __name__ == "__main__":
  sys.exit(compute_dp_sgd_privacy_main())
