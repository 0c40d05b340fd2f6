"""Bazel entry point of the console script `compute_noise_from_budget` (pyproject.toml: tf_dpiter.accounting.cli:compute_noise_from_budget_main)."""

import sys

from tf_dpiter.accounting.cli import compute_noise_from_budget_main

if __name__ == "__main__":
  sys.exit(compute_noise_from_budget_main())
