"""Console scripts: compute_dp_sgd_privacy, compute_noise_from_budget, dp_ledger.

Also `python -m tf_dpiter.accounting <command> ...`. `compute_dp_sgd_privacy` takes TF
Privacy's flags too (`--[no]used_microbatching`, `--max_examples_per_user`,
`--accountant_type RDP|PLD`); any of them prints TF Privacy's privacy statement. They import
no TensorFlow, so `--help` answers at once. Counts accept whole numbers in float notation.
"""

import argparse
import json
import math
import re
import sys
import warnings

from tf_dpiter.accounting import accountant as accountant_lib
from tf_dpiter.accounting import calibration
from tf_dpiter.accounting import curve as curve_lib
from tf_dpiter.accounting import dp_sgd
from tf_dpiter.accounting import statement as statement_lib
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import records as rec

_NUMPY_SCALAR = re.compile(r"np\.(?:float|int|uint)\d*\(([^()]*)\)")


def plain_numbers(text):
  """A message with numpy scalar reprs (np.float64(1.5)) replaced by their plain value (1.5),
  for a command-line user."""
  return _NUMPY_SCALAR.sub(r"\1", text)


def whole_number(text):
  """argparse type: the int of an integer, also written in float notation (1e5, 60000.0).

  Raises:
    argparse.ArgumentTypeError: not a finite whole number.
  """
  try:
    v = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
  if not math.isfinite(v) or v != math.floor(v):
    raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}")
  return int(v)


def cli_accountants():
  """The accountant names the commands offer (`--accountant` choices), read when a command's
  parser is built: the registered ones and "gdp"; not "prv" (not available)."""
  return tuple(a for a in accountant_lib.report_accountant_names() if a != "prv")
_TRUE, _FALSE = ("1", "t", "true", "y", "yes"), ("0", "f", "false", "n", "no")


def absl_bool(text):
  """argparse type: the bool of an absl boolean flag value (true/false, 1/0, yes/no; any
  case).

  Raises:
    argparse.ArgumentTypeError: another string.
  """
  if text.lower() in _TRUE:
    return True
  if text.lower() in _FALSE:
    return False
  raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")


def _run(fn):
  """Runs fn: 0, or 2 after "error: ..." for a ValueError; its warnings are printed once
  each as "warning: ..." on stderr."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      fn()
      status = 0
    except ValueError as e:
      print(f"error: {plain_numbers(str(e))}", file=sys.stderr)
      status = 2
  for message in dict.fromkeys(str(w.message) for w in caught
                               if issubclass(w.category, UserWarning)):
    print(f"warning: {plain_numbers(message)}", file=sys.stderr)
  for w in caught:
    if not issubclass(w.category, UserWarning):
      warnings.showwarning(w.message, w.category, w.filename, w.lineno)
  return status


def _dp_sgd_parser(prog, description, knob):
  """Parser with the DP-SGD arguments; `knob` is --noise_multiplier or --epsilon."""
  p = argparse.ArgumentParser(prog=prog, description=description)
  p.add_argument("--N", type=whole_number, required=True, help="number of training records")
  p.add_argument("--batch_size", type=whole_number, required=True)
  p.add_argument(knob, type=float, required=True)
  p.add_argument("--epochs", type=float, required=True)
  p.add_argument("--delta", type=float, required=True)
  p.add_argument("--accountant", choices=cli_accountants(), default=None,
                 help="rdp (default), pld (dp-accounting) or a registered accountant "
                      "(accounting.register_accountant); gdp is an approximation (TF "
                      "Privacy's GDP; its value is labelled approximate, and "
                      "compute_noise_from_budget refuses it)")
  p.add_argument("--accountant_type", choices=("RDP", "PLD"), default=None,
                 help="TF Privacy's spelling of --accountant rdp / pld")
  p.add_argument("--sampling", choices=rec.POLICIES, default=None,
                 help="poisson (default; add/remove one example: fit(x, y) on arrays without "
                      "microbatches), fixed_size or shuffle (replace one: a shuffled "
                      "pipeline, or fit with num_microbatches)")
  return p


def _accountant(a):
  """The accountant of --accountant / --accountant_type (they must agree); rdp by default."""
  if a.accountant_type is not None:
    if a.accountant is not None and a.accountant != a.accountant_type.lower():
      raise PrivacyConfigError(f"--accountant {a.accountant} and --accountant_type "
                               f"{a.accountant_type} disagree: give one of them")
    return a.accountant_type.lower()
  return a.accountant or "rdp"


def compute_dp_sgd_privacy_main(argv=None):
  """Command `compute_dp_sgd_privacy`: epsilon of DP-SGD from its hyperparameters. Prints
  `accounting.compute_dp_sgd_privacy`, or TF Privacy's statement
  (`compute_dp_sgd_privacy_statement`) with --statement or any of TF Privacy's flags.
  Returns the exit status: 0, or 2 after printing "error: ..." for a refused argument."""
  p = _dp_sgd_parser("compute_dp_sgd_privacy", "Epsilon of DP-SGD from its hyperparameters.",
                     "--noise_multiplier")
  p.add_argument("--num_microbatches", type=whole_number, default=None,
                 help="microbatches per batch (sensitivity 2C per example; not with poisson)")
  p.add_argument("--statement", action="store_true",
                 help="print TF Privacy's statement instead (both samplings, user level)")
  p.add_argument("--max_examples_per_user", type=whole_number, default=None,
                 help="TF Privacy's flag: also a user-level epsilon (group privacy); prints "
                      "the statement")
  p.add_argument("--used_microbatching", nargs="?", const=True, default=None, type=absl_bool,
                 metavar="true|false",
                 help="TF Privacy's flag (its default is true): gradients were clipped per "
                      "microbatch, so no Poisson number is given; prints the statement")
  p.add_argument("--noused_microbatching", dest="used_microbatching", action="store_false",
                 default=None,
                 help="TF Privacy's flag: clipped per example (no microbatches); prints the "
                      "statement with the Poisson number too")
  a = p.parse_args(argv)
  tfp_style = a.statement or a.used_microbatching is not None or (
      a.max_examples_per_user is not None) or a.accountant_type is not None

  def go():
    accountant = _accountant(a)
    accountant_lib.warn_if_delta_too_large(a.delta, a.N)   # `_run` prints it
    if tfp_style:
      print(statement_lib.compute_dp_sgd_privacy_statement(
          a.N, a.batch_size, a.epochs, a.noise_multiplier, a.delta,
          used_microbatching=_used_microbatching(a),
          max_examples_per_user=a.max_examples_per_user, accountant=accountant))
      return
    sampling = a.sampling or rec.POISSON
    r = dp_sgd.compute_dp_sgd_privacy(a.N, a.batch_size, a.noise_multiplier, a.epochs, a.delta,
                                      accountant=accountant, sampling=sampling,
                                      num_microbatches=a.num_microbatches)
    print(r.statement)
    print(f"epsilon = {r.epsilon:.6g}" if accountant != "gdp" else
          f"epsilon ~ {r.epsilon:.6g} (GDP: approximate, not an upper bound)")
    if sampling == rec.POISSON:
      print(POISSON_NOTE)
  return _run(go)


POISSON_NOTE = (
    "note: this epsilon assumes Poisson sampling, which fit(x, y, batch_size=B) on arrays "
    "does without num_microbatches. A run with num_microbatches (TF Privacy's habit) or on "
    "a shuffled tf.data pipeline samples by shuffled passes and spends more: compute it with "
    "--sampling shuffle [--num_microbatches M], or read the run's own ledger with "
    "`dp_ledger report`, which states how the run sampled.")


def _used_microbatching(a):
  """TF Privacy's used_microbatching: the flag, else whether --num_microbatches was given
  (they must agree); refuses --sampling, which the statement does not take."""
  if a.sampling is not None:
    raise PrivacyConfigError(f"--sampling {a.sampling} is not used by the statement (it gives the "
                             "each-example-once-per-epoch number and, without microbatching, the "
                             "Poisson one): drop --sampling, or drop the statement flags")
  if a.used_microbatching is None:
    return a.num_microbatches is not None
  if a.used_microbatching is False and a.num_microbatches is not None:
    raise PrivacyConfigError(f"--noused_microbatching contradicts --num_microbatches "
                             f"{a.num_microbatches}: give one of them")
  return a.used_microbatching


def compute_noise_from_budget_main(argv=None):
  """Command `compute_noise_from_budget`: prints the smallest noise multiplier z meeting
  (epsilon, delta) (`accounting.compute_noise_from_budget`) and the epsilon it gives.
  Returns the exit status: 0, or 2 after printing "error: ..." for a refused argument."""
  a = _dp_sgd_parser("compute_noise_from_budget",
                     "Noise multiplier for DP-SGD meeting (epsilon, delta).",
                     "--epsilon").parse_args(argv)

  def go():
    accountant, sampling = _accountant(a), a.sampling or rec.POISSON
    accountant_lib.warn_if_delta_too_large(a.delta, a.N)   # `_run` prints it
    z = calibration.compute_noise_from_budget(a.N, a.batch_size, a.epsilon, a.epochs, a.delta,
                                              accountant=accountant, sampling=sampling)
    eps = dp_sgd.compute_dp_sgd_privacy(a.N, a.batch_size, z, a.epochs, a.delta,
                                        accountant=accountant, sampling=sampling).epsilon
    print(f"noise_multiplier = {z:.6g}  (gives epsilon = {eps:.6g} <= {a.epsilon:g} at "
          f"delta = {a.delta:g})")
    if sampling == rec.POISSON:
      print(POISSON_NOTE)
  return _run(go)


def _read_ledger(path, key_file):
  """(verified ledger dict, key or None); ValueError naming the file."""
  key = None
  if key_file:
    try:
      with open(key_file, "rb") as f:
        key = f.read().strip()
    except OSError as e:
      raise ParameterValueError(f"key file {key_file!r} could not be read: {e}") from None
  try:
    with open(path) as f:
      d = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ParameterValueError(f"ledger file {path!r} could not be read: {e}") from None
  try:
    accountant_lib.ledger_runs(d, key)     # verifies digest / HMAC and every run
  except ValueError as e:
    raise ParameterValueError(f"ledger file {path!r}: {e}") from None
  return d, key


def _query_text(q):
  if "stddev" in q:   # gaussian, and the correlated banded/tree/matrix gaussian kinds
    z = q["stddev"] / q["sensitivity"] if q["sensitivity"] else math.inf
    return (f"{q['type']} clip {q['l2_norm_clip']:g}, stddev {q['stddev']:g}, sensitivity "
            f"{q['sensitivity']:g} (noise multiplier {z:.4g})")
  if q["type"] == "laplace":
    return (f"laplace clip {q['l1_norm_clip']:g}, scale {q['scale']:g}, sensitivity "
            f"{q['sensitivity']:g}")
  return "NON-PRIVATE (no noise)"


def format_ledger(d, path="ledger"):
  """The human-readable text of a ledger dict already verified (`ledger_file`): a header
  naming it `path`, then one block per run."""
  runs = d["runs"]
  lines = [f"{path}: {d['num_samples']} samples in {len(runs)} runs, {d['passes']} shuffled "
           f"passes recorded; integrity: sha256 digest ok"
           + (", HMAC present" if "hmac" in d else ", no HMAC")]
  first = 1
  for i, r in enumerate(runs):
    last = first + r["count"] - 1
    unit = rec.unit_of_policy(r["policy"])
    if unit == "example" and r["examples_per_record"] > 1:
      unit = f"microbatch of {r['examples_per_record']} examples"
    lines.append(f"run {i + 1}: steps {first}-{last} ({r['count']}), {r['policy']} sampling, "
                 f"n = {r['population_size']:g}, q = {r['selection_probability']:.6g}, batch "
                 f"{r['sample_size']:g}; {r['relation'].replace('_', ' ')} {unit}")
    lines += [f"    query {j + 1}: {_query_text(q)}" for j, q in enumerate(r["queries"])]
    first = last + 1
  return "\n".join(lines)


def _single_gaussian_noise(r):
  """z = stddev / clip of a run's one Gaussian query, or None (another kind of run)."""
  if len(r["queries"]) != 1 or r["queries"][0].get("type") != "gaussian":
    return None
  q = r["queries"][0]
  return q["stddev"] / q["l2_norm_clip"] if q.get("l2_norm_clip") else None


def sampling_lines(d, delta):
  """A line (str) for every run of a verified ledger dict that did not sample single
  examples by Poisson (what `compute_dp_sgd_privacy` assumes), with the call that
  reproduces the run (delta None: the calls name it DELTA); empty when every run is."""
  lines = []
  for i, r in enumerate(d["runs"]):
    k = r["examples_per_record"]
    if r["policy"] == rec.POISSON and k <= 1:
      continue
    n, b = r["population_size"], r["sample_size"]
    what = f"{r['policy']} sampling" + (f" of microbatches of {k} examples" if k > 1 else "")
    line = (f"run {i + 1} used {what}, not the Poisson sampling of single examples that "
            "compute_dp_sgd_privacy (ours by default, and TF Privacy's) assumes, so a number "
            "from the hyperparameters alone is not this run's epsilon")
    z = _single_gaussian_noise(r)
    if z is not None and r["policy"] in rec.POLICIES and n > 0 and b > 0:
      m = f" --num_microbatches {max(1, round(b / k))}" if k > 1 else ""
      line += (f"; the same run from its hyperparameters: compute_dp_sgd_privacy --N {n:g} "
               f"--batch_size {b:g} --noise_multiplier {z:.6g} --epochs "
               f"{r['count'] * b / n:.6g} --delta {'DELTA' if delta is None else f'{delta:g}'} --sampling {r['policy']}{m}")
    lines.append(line)
  return lines


def _ledger_parser():
  p = argparse.ArgumentParser(prog="dp_ledger", description="Read a privacy ledger JSON file.")
  sub = p.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("report", help="epsilon (or delta) of a ledger file")
  g = r.add_mutually_exclusive_group(required=True)
  g.add_argument("--delta", type=float)
  g.add_argument("--epsilon", type=float)
  s = sub.add_parser("show", help="the runs of a ledger file, human-readable")
  pl = sub.add_parser("plot", help="PNG of epsilon over steps")
  pl.add_argument("--delta", type=float, required=True)
  pl.add_argument("--out", required=True, help="output PNG path")
  pl.add_argument("--points", type=whole_number, default=50, help="points of the curve")
  for q in (r, s, pl):
    q.add_argument("ledger", help="path to a ledger JSON file")
    q.add_argument("--key-file", default=None,
                   help="file holding the HMAC key the ledger was saved with (checked)")
  for q in (r, pl):
    q.add_argument("--accountant", choices=cli_accountants(), default="rdp")
  return p


def dp_ledger_main(argv=None):
  """Command `dp_ledger`: `show`, `report` or `plot` a saved ledger JSON file, verified
  (digest; HMAC with --key-file) before anything is read from it. Returns the exit status:
  0, or 2 after printing "error: ..." (naming the file) for a refused ledger or argument."""
  a = _ledger_parser().parse_args(argv)

  def go():
    d, key = _read_ledger(a.ledger, a.key_file)
    try:
      if a.cmd == "show":
        print(format_ledger(d, a.ledger))
      elif a.cmd == "plot":
        c = curve_lib.epsilon_curve(d, a.delta, accountant=a.accountant, num_points=a.points,
                                    key=key)
        curve_lib.plot_epsilon_curve(c, a.out)
        print(f"wrote {a.out}: epsilon from {c.epsilon[0]:.4g} (step {c.steps[0]}) to "
              f"{c.epsilon[-1]:.4g} (step {c.steps[-1]}) at delta = {a.delta:g}"
              + (" (GDP: approximate, not an upper bound)" if a.accountant == "gdp" else ""))
      else:
        print(accountant_lib.privacy_report(d, delta=a.delta, epsilon=a.epsilon,
                                            accountant=a.accountant, key=key))
        for line in sampling_lines(d, a.delta):
          print(f"note: {line}")
    except ValueError as e:
      raise ParameterValueError(f"ledger file {a.ledger!r}: {e}") from None
  return _run(go)
