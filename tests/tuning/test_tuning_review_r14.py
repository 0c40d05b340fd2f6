"""Review R14 (session 45): private selection with a random number of trials.

Papernot and Steinke, "Hyperparameter Tuning with Renyi Differential Privacy" (Theorems 2
and 6): the selection's epsilon is dp-accounting's RepeatAndSelectDpEvent(event, mean,
shape), which accounts a Poisson number of trials only for mean >= 1. A search that cannot be
accounted must be refused before any trial trains.
"""

import numpy as np
import pytest

from tf_dpiter import tuning
from tf_dpiter.errors import ParameterTypeError, ParameterValueError


def test_a_poisson_mean_the_accountant_cannot_account_is_refused_before_training():
  with pytest.raises(ParameterValueError, match="mean"):
    tuning.num_trials_distribution(0.5, float("inf"))
  with pytest.raises(ParameterValueError, match="mean"):
    tuning.RandomSearch(0.5, shape=float("inf"), seed=0)


def test_the_ledgers_selection_marker_refuses_a_poisson_mean_below_one():
  """The ledger's own check (a marker read from a file or written by another tool) agrees:
  a mean dp-accounting cannot account is refused when the marker is made, for every shape."""
  from tf_dpiter.ledger import selection
  for shape in (float("inf"), 1.0):
    with pytest.raises(ParameterValueError, match="`mean` must be finite and >= 1"):
      selection.Selection(0.5, shape, 1, 0)
  assert selection.Selection(1.0, float("inf"), 1, 0).mean == 1.0
  for flag in (True, np.True_):   # a bool is no mean (review R16: np.True_ was taken as 1)
    with pytest.raises(ParameterTypeError, match="`mean` must be a number"):
      selection.Selection(flag, float("inf"), 1, 0)
