"""The policy x scenario matrix as a table: participations measured vs the ledger's claim.

Every registered sampling policy x {one fit, several fits with steps_per_epoch, a new dataset,
a crash + BackupAndRestore, save -> load -> fit}, each the real Keras pipeline with noise 0
on n = 24 one-hot examples (tests/privacy/matrix_runs.py, the same runs as
tests/privacy/test_policy_matrix.py). A cell reads "m/M, g/G" (the most participations of one
unit measured / claimed by the ledger's rows through the policy object, the least gap between
two of them measured / claimed; "-" when no unit joined twice), or "refused" when a fit of the
scenario was refused before its first step.

usage: python -m benchmarks.policy_matrix [--policies a,b] [--scenarios c,d]
"""

import argparse
import math
import os
import platform
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from tests.privacy import matrix_runs  # noqa: E402  pylint: disable=wrong-import-position
from tf_dpiter.ledger import policies  # noqa: E402  pylint: disable=wrong-import-position


def cell(policy, scenario):
  """One cell's text and whether it keeps the claim (True) or breaks it (False)."""
  with tempfile.TemporaryDirectory() as work:
    net, joined, refused = matrix_runs.run(policy, scenario, work)
    if refused is not None:
      return f"refused ({refused.steps} steps)", refused.steps == 0
    most, gap = matrix_runs.claim(net.ledger)
    got_most, got_gap, _, _ = matrix_runs.measured(matrix_runs.Case(policy), joined)
    every_step = net.ledger.get_arrays()[0].shape[0] == len(joined)
    show = lambda g: "-" if g == math.inf else str(g)
    ok = every_step and got_most <= most and got_gap >= gap
    return (f"{got_most}/{most}, {show(got_gap)}/{gap}" + ("" if ok else " BROKEN"), ok)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--policies", default=",".join(policies.names()))
  parser.add_argument("--scenarios", default=",".join(matrix_runs.SCENARIOS))
  args = parser.parse_args()
  scenarios = args.scenarios.split(",")
  start = time.time()
  print(f"n = {matrix_runs.N}, batch {matrix_runs.BATCH}, b = {matrix_runs.GROUPS} (cyclic, "
        f"BandMF), cap {matrix_runs.CAP} (truncated), {matrix_runs.USERS_K} examples per user; "
        f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
  print("| policy | " + " | ".join(scenarios) + " |")
  print("|---|" + "---|" * len(scenarios))
  broken = 0
  for policy in args.policies.split(","):
    row = []
    for scenario in scenarios:
      text, ok = cell(policy, scenario)
      broken += not ok
      row.append(text)
    print(f"| {policy} | " + " | ".join(row) + " |", flush=True)
  print(f"{broken} cells break the claim; {time.time() - start:.0f} s")
  return 1 if broken else 0


if __name__ == "__main__":
  sys.exit(main())
