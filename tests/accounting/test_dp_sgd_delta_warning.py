"""compute_dp_sgd_privacy (TF Privacy's habit) warns when delta >= 1/n, naming delta and n,
and its statement says what such a delta allows; the multi-line statement warns once."""

import warnings

import pytest

from tf_dpiter import accounting


def test_large_delta_warns_and_the_statement_says_so():
  with pytest.warns(UserWarning, match=r"delta=0\.02 is >= 1/n = 1/100 = 0\.01"):
    result = accounting.compute_dp_sgd_privacy(100, 10, 1.0, 1, 0.02)
  assert "delta = 0.02 >= 1/n = 0.01" in result.statement
  assert "revealing about one record outright" in result.statement


def test_small_delta_is_quiet():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    result = accounting.compute_dp_sgd_privacy(100, 10, 1.0, 1, 1e-3)
  assert "1/n" not in result.statement


def test_the_multi_line_statement_warns_once():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    accounting.compute_dp_sgd_privacy_statement(100, 10, 1, 1.0, 0.05,
                                                used_microbatching=False)
  assert sum("1/n" in str(w.message) for w in caught) == 1
