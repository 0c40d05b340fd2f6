"""Console scripts: compute_dp_sgd_privacy, compute_noise_from_budget, dp_ledger."""

import argparse
import json
import sys

from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.accounting import calibration
from tf_dpiter.accounting import dp_sgd
from tf_dpiter.ledger import records as rec


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
  p.add_argument("--sampling", choices=rec.POLICIES, default=rec.POISSON,
                 help="poisson (add/remove one example), fixed_size or shuffle (replace one)")
  return p


def compute_dp_sgd_privacy_main(argv=None):
  p = _dp_sgd_parser("compute_dp_sgd_privacy", "Epsilon of DP-SGD from its hyperparameters.",
                     "--noise_multiplier")
  p.add_argument("--num_microbatches", type=int, default=None,
                 help="microbatches per batch (sensitivity 2C per example; not with poisson)")
  a = p.parse_args(argv)

  def go():
    r = dp_sgd.compute_dp_sgd_privacy(a.N, a.batch_size, a.noise_multiplier, a.epochs, a.delta,
                                      accountant=a.accountant, sampling=a.sampling,
                                      num_microbatches=a.num_microbatches)
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
  r.add_argument("--key-file", default=None,
                 help="file holding the HMAC key the ledger was saved with (checked)")
  a = p.parse_args(argv)

  def go():
    key = None
    if a.key_file:
      with open(a.key_file, "rb") as f:
        key = f.read().strip()
    try:
      with open(a.ledger) as f:
        d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f"ledger file {a.ledger!r} could not be read: {e}") from None
    try:
      report = accountant_lib.privacy_report(d, delta=a.delta, epsilon=a.epsilon,
                                             accountant=a.accountant, key=key)
    except ValueError as e:
      raise ValueError(f"ledger file {a.ledger!r}: {e}") from None
    print(report)
  return _run(go)
