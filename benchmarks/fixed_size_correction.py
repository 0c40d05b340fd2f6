"""Issue 11: what fixed-size (replace-one) sampling costs after the sensitivity fix.

For each setting, the delta at epsilon = 8 (Geyer et al. 2017 fixes epsilon) and the epsilon at the
preset's delta_0: as the old code accounted it (dp-accounting's SampledWithoutReplacement
with z = sigma / S) and as the ledger accounts it now (z = sigma / 2S under replace one),
next to Poisson sampling with q = m / K (what Table 1 used). Accounting only: the training
is the same, so accuracy does not change; the corrected budget stops a fixed-size run earlier.

  python benchmarks/fixed_size_correction.py
"""

import dp_accounting as dpa

from tf_dpiter import accounting
from tf_dpiter.accounting import dp_sgd

SETTINGS = [  # (name, K, m, z, rounds, delta_0)
    ("k100 preset", 100, 100, 1.65, 10, 1e-3),
    ("k1000 preset", 1000, 300, 1.62, 50, 1e-5),
    ("k10000 preset", 10000, 500, 0.88, 180, 1e-6),
    ("issue 11 example", 1000, 999, 2.0, 100, 1e-5),
]


def _old(k, m, z, rounds):
  acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
  if m < k:
    acc.compose(dpa.SampledWithoutReplacementDpEvent(k, m, dpa.GaussianDpEvent(z)), rounds)
  else:
    acc.compose(dpa.GaussianDpEvent(z), rounds)
  return acc


def main():
  print("| setting | K | m | z | rounds | δ at ε=8, old fixed-size | δ at ε=8, corrected "
        "fixed-size | δ at ε=8, Poisson | ε at δ₀, old | ε at δ₀, corrected | ε at δ₀, Poisson |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for name, k, m, z, rounds, d0 in SETTINGS:
    old = _old(k, m, z, rounds)
    fixed = dp_sgd.dp_sgd_groups(k, m, z, rounds, "fixed_size" if m < k else "full")
    if m == k:  # every client every round: "full" is add/remove; replace one costs 2S
      fixed = dp_sgd.dp_sgd_groups(k, m, z, rounds, "fixed_size")
    pois = dp_sgd.dp_sgd_groups(k, m, z, rounds, "poisson")
    row = [old.get_delta(8.0), accounting.report_from_groups(fixed, epsilon=8.0).delta,
           accounting.report_from_groups(pois, epsilon=8.0).delta,
           old.get_epsilon(d0), accounting.report_from_groups(fixed, delta=d0).epsilon,
           accounting.report_from_groups(pois, delta=d0).epsilon]
    print(f"| {name} | {k} | {m} | {z} | {rounds} | " + " | ".join(f"{v:.3g}" for v in row) + " |")


if __name__ == "__main__":
  main()
