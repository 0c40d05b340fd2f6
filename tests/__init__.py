"""The tests of tf_dpiter, one folder per subpackage (run from the repository root: pytest)."""
