"""Bazel entry point of the console script `dp_ledger` (pyproject.toml: tf_dpiter.accounting.cli:dp_ledger_main)."""

import sys

from tf_dpiter.accounting.cli import dp_ledger_main

if __name__ == "__main__":
  sys.exit(dp_ledger_main())
