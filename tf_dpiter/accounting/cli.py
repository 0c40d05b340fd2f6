"""Console scripts: compute_dp_sgd_privacy, compute_noise_from_budget, dp_ledger."""

import argparse
import sys

from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.accounting import calibration
from tf_dpiter.accounting import dp_sgd
from tf_dpiter.ledger import privacy_ledger as pl


def _run(fn):
  try:
    fn()
    return 0
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


def _dp_sgd_parser(prog, description, knob):
  """Parser with the DP-SGD arguments; `knob` is --noise_multiplier or --epsilon."""
  p = argparse.ArgumentParser(prog=prog, description=description)
  p.add_argument("--N", type=int, required=True, help="number of training records")
  p.add_argument("--batch_size", type=int, required=True)
  p.add_argument(knob, type=float, required=True)
  p.add_argument("--epochs", type=float, required=True)
  p.add_argument("--delta", type=float, required=True)
  p.add_argument("--accountant", choices=accountant_lib.ACCOUNTANTS, default="rdp")
  p.add_argument("--sampling", choices=pl.POLICIES, default=pl.POISSON)
  return p


def compute_dp_sgd_privacy_main(argv=None):
  a = _dp_sgd_parser("compute_dp_sgd_privacy", "Epsilon of DP-SGD from its hyperparameters.",
                     "--noise_multiplier").parse_args(argv)

  def go():
    r = dp_sgd.compute_dp_sgd_privacy(a.N, a.batch_size, a.noise_multiplier, a.epochs, a.delta,
                                      accountant=a.accountant, sampling=a.sampling)
    print(r.statement)
    print(f"epsilon = {r.epsilon:.6g}")
  return _run(go)


def compute_noise_from_budget_main(argv=None):
  a = _dp_sgd_parser("compute_noise_from_budget",
                     "Noise multiplier for DP-SGD meeting (epsilon, delta).",
                     "--epsilon").parse_args(argv)

  def go():
    z = calibration.compute_noise_from_budget(a.N, a.batch_size, a.epsilon, a.epochs, a.delta,
                                              accountant=a.accountant, sampling=a.sampling)
    eps = dp_sgd.compute_dp_sgd_privacy(a.N, a.batch_size, z, a.epochs, a.delta,
                                        accountant=a.accountant, sampling=a.sampling).epsilon
    print(f"noise_multiplier = {z:.6g}  (gives epsilon = {eps:.6g} <= {a.epsilon} at delta = {a.delta})")
  return _run(go)


def dp_ledger_main(argv=None):
  p = argparse.ArgumentParser(prog="dp_ledger", description="Read a privacy ledger JSON file.")
  sub = p.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("report", help="epsilon (or delta) of a ledger file")
  r.add_argument("ledger", help="path to a ledger JSON file")
  g = r.add_mutually_exclusive_group(required=True)
  g.add_argument("--delta", type=float)
  g.add_argument("--epsilon", type=float)
  r.add_argument("--accountant", choices=accountant_lib.ACCOUNTANTS, default="rdp")
  a = p.parse_args(argv)

  def go():
    ledger = pl.PrivacyLedger.load_json(a.ledger)
    print(accountant_lib.privacy_report(ledger, delta=a.delta, epsilon=a.epsilon,
                                        accountant=a.accountant))
  return _run(go)
