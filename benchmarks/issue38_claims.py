"""Issue 38, findings 6, 7 and 8: claimed epsilon against true epsilon, before and after.

  python -m benchmarks.issue38_claims

6. fit's Poisson q at n = 8, B = 6, z = 1, 10 steps, delta = 1e-5: the ledger's claim
   (dp-accounting by hand) against the exact epsilon of a concrete neighbouring pair
   (`tests/privacy/test_declared_population.py`: numpy/scipy privacy-loss distribution), with
   the neighbour of 7 records sampled at its own q = 6/7 (q from len(x)) and at the declared
   q = 6/8 (fit(..., population_size=8)).
7. GDP against PLD by hand at TF Privacy's MovieLens setting (n = 800,167, B = 10,000,
   z = 0.55, delta = 1e-6): 3 epochs, and the run a GDP budget of 4 would allow.
8. report_from_groups on balls-in-bins groups with correlated rows the policy does not cover.
Each "after" line says whether the library now refuses the configuration.
"""

import warnings

import dp_accounting as dpa

from tf_dpiter import accounting
from tf_dpiter.accounting import dp_sgd
from tf_dpiter.accounting import ledger_events
from tf_dpiter.errors import PrivacyConfigError
from tests.privacy import test_declared_population as exact


def _poisson(q, z, steps, delta, pld=True):
  acc = dpa.pld.PLDAccountant() if pld else dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)),
                                      steps))
  return acc.get_epsilon(delta)


def finding_6():
  n, b, z, t, d = exact.N, exact.B, exact.Z, exact.EPOCHS, exact.DELTA
  claim = (_poisson(b / n, z, t, d, pld=False), _poisson(b / n, z, t, d))
  own_q = exact._pair_epsilon(b / n, b / (n - 1))          # pylint: disable=protected-access
  same_q = exact._pair_epsilon(b / n, b / n)               # pylint: disable=protected-access
  worst = exact._pair_epsilon(b / n, b / n, 0, 1)          # pylint: disable=protected-access
  print(f"6  claim RDP {claim[0]:.2f} / PLD {claim[1]:.2f}; exact pair, neighbour at q=6/7 "
        f"(before, and the default's n-private reading) {own_q:.2f}; at the declared q=6/8 "
        f"{same_q:.2f} (dominating pair {worst:.3f})")


def finding_7():
  n, b, z, d = 800167, 10000, 0.55, 1e-6
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    gdp = accounting.compute_dp_sgd_privacy(n, b, z, 3, d, accountant="gdp")
  print(f"7  3 epochs ({gdp.steps} steps): GDP {gdp.epsilon:.3f}, PLD by hand "
        f"{_poisson(b / n, z, gdp.steps, d):.3f}")
  gdp_eps = lambda t: accounting.report_from_groups(
      dp_sgd.dp_sgd_groups(n, b, z, t, "poisson"), delta=d, accountant="gdp").epsilon
  lo, hi = 1, 2
  while gdp_eps(hi) <= 4.0:
    lo, hi = hi, 2 * hi
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if gdp_eps(mid) <= 4.0 else (lo, mid)
  try:
    accounting.StepBudget(4.0, d, accountant="gdp")
    after = "accepted"
  except PrivacyConfigError as e:
    after = f"refused ({type(e).__name__})"
  print(f"7  a GDP budget of 4 allows {lo} steps: GDP {gdp_eps(lo):.3f}, PLD by hand "
        f"{_poisson(b / n, z, lo, d):.3f}; StepBudget(4, accountant='gdp'): {after}")


def finding_8():
  out = []
  for rows in ("banded", "matrix", "tree"):
    g = ledger_events.SampleGroup(10, "balls_in_bins", 1000.0, 0.1, 10.0, 1.0, (), False,
                                  correlated=rows, tree_depth=3 if rows == "tree" else 0)
    try:
      eps = accounting.report_from_groups([g], delta=1e-5, accountant="pld", passes=1).epsilon
      out.append(f"{rows}: epsilon {eps:.3f}")
    except PrivacyConfigError as e:
      out.append(f"{rows}: refused ({type(e).__name__})")
  print("8  balls_in_bins, 10 steps of k = 10, n = 1000, z = 1, PLD: " + "; ".join(out))


if __name__ == "__main__":
  finding_6()
  finding_7()
  finding_8()
