"""Bazel entry point of the console script `tf-dpiter-ddml` (pyproject.toml: tf_dpiter.draw_discard.cli:main)."""

import sys

from tf_dpiter.draw_discard.cli import main

if __name__ == "__main__":
  sys.exit(main())
