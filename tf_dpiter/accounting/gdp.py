"""Gaussian differential privacy (mu-GDP) accounting of a ledger: TF Privacy's GDP accountant.

Dong, Roth and Su, "Gaussian Differential Privacy": a Gaussian of noise multiplier z is
exactly (1/z)-GDP; mu_i-GDP mechanisms compose to sqrt(sum mu_i^2)-GDP. Poisson subsampling
(rate q, T steps) uses the central limit theorem of Bu, Dong, Long and Su, "Deep Learning
with Gaussian Differential Privacy", Section 3: mu = q sqrt(T (e^(1/z^2) - 1)), an
APPROXIMATION, not an upper bound (it can understate epsilon): labelled approximate, and
refused by budgets and calibrations (`accountant.check_bound_accountant`).

mu-GDP implies (epsilon, delta(epsilon))-DP for all epsilon with (Dong et al., Corollary 2.13)
  delta(epsilon) = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2).
Only Gaussian queries under Poisson sampling (q < 1, approximate) or full batches (exact) are
accounted; other policies and Laplace queries are refused.
"""

import math

from tf_dpiter.accounting import policy_accounting
from tf_dpiter.accounting import search
from tf_dpiter.errors import PrivacyConfigError

CAVEAT = ("GDP accountant (mu-GDP; Poisson subsampling by the central limit theorem of Bu et "
          "al. 2020, as TF Privacy's gdp_accountant): an APPROXIMATION, not an upper bound; "
          "it can understate epsilon. Use 'rdp' or 'pld' for a guarantee")


def _norm():
  from scipy import stats  # pylint: disable=g-import-not-at-top
  return stats.norm


def group_mu_squared(group):
  """mu^2 of one `ledger_events.SampleGroup` of `count` samples, a float (inf for a
  non-private group, 0 without noise cost), by the CLT for Poisson sampling (Bu, Dong, Long
  and Su, "Deep Learning with Gaussian Differential Privacy"): full batch count / z^2;
  Poisson with rate q count q^2 (e^{1/z^2} - 1).

  Raises:
    PrivacyConfigError: Laplace queries, or a policy other than Poisson or full batch.
  """
  if group.non_private:
    return math.inf
  if group.is_selection:
    raise PrivacyConfigError("accountant='gdp' cannot account a private selection record "
                             "(repeat_and_select): a ledger with one is accounted by the RDP "
                             "accountant only. Received: accountant='gdp'")
  if group.laplace_noise_multipliers:
    raise PrivacyConfigError("accountant='gdp' accounts Gaussian queries only; this ledger has Laplace "
                             "queries: use accountant='rdp' or 'pld'")
  z = group.noise_multiplier
  return policy_accounting.get(group.policy).gdp_mu_squared(group) if math.isfinite(z) else 0.0


def mu_of_groups(groups):
  """mu of the composition of all SampleGroups: sqrt(sum of the groups' mu^2).

  Raises:
    PrivacyConfigError: no group (an empty ledger), or a group GDP cannot account.
  """
  if not groups:
    raise PrivacyConfigError("ledger is empty: no samples were recorded, so there is nothing to account")
  return math.sqrt(sum(group_mu_squared(g) for g in groups))


def delta_from_mu(mu, epsilon):
  """delta(epsilon) in [0, 1] of mu-GDP, mu >= 0 (inf: no privacy), epsilon >= 0:
  Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2) (Dong, Roth and Su, "Gaussian
  Differential Privacy", Corollary 2.13)."""
  if mu == 0:
    return 0.0
  if not math.isfinite(mu):
    return 1.0
  norm = _norm()
  return float(norm.cdf(-epsilon / mu + mu / 2)
               - math.exp(epsilon + norm.logcdf(-epsilon / mu - mu / 2)))


def epsilon_from_mu(mu, delta):
  """The smallest epsilon >= 0 with delta(epsilon) <= delta in (0, 1) for mu-GDP
  (`search.bisect`, 1e-10); inf for mu = inf."""
  if mu == 0:
    return 0.0
  if not math.isfinite(mu):
    return math.inf
  if delta_from_mu(mu, 0.0) <= delta:
    return 0.0
  ok = lambda e: delta_from_mu(mu, e) <= delta
  bad, good = search.doubling_bracket(ok, max(1.0, mu))
  return search.bisect(ok, bad, good, rel_tol=1e-10)
