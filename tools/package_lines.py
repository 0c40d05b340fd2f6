"""The package's lines at two revisions, and its growth split into new features and the rest.

Issue 41 asks for the package "10 % smaller in lines at equal features". Features were added
since the base, so the raw count alone cannot show it. This tool counts the lines of every
Python file under tf_dpiter/ at two git revisions, read with `git show` (nothing is checked
out). Lines are counted as `tools/structure_metrics.py` counts them: `len(text.splitlines())`
per file. It then splits the growth into:

  (a) the files added since the base for a new feature: the files of `FEATURE_FILES`, each
      named with the commit that added it and the CHANGELOG entry or commit line that says
      which feature it is (made from `git log --diff-filter=A BASE..HEAD -- tf_dpiter` and
      CHANGELOG.md);
  (b) everything else: the files present at the base, and the files added to restructure
      code that was already there (`STRUCTURE_FILES`: moves, cycle cuts, the frozen plan).

and prints "lines at equal features" = lines now - (a), against the base's lines. Features
added inside files that already existed are not subtracted, so the figure errs towards
"larger". A file added since the base that neither table names is listed as "unclassified"
and counted in (b), so that a new file cannot be left out silently.

Usage (from the repository root):
  python tools/package_lines.py [--base 7ec3ad6] [--now HEAD] [--json]
"""

import argparse
import json
import pathlib
import subprocess
import sys

PACKAGE = "tf_dpiter"
BASE = "7ec3ad6"   # issue 41's start: 35,634 lines in 185 files

# path -> (commit that added it, the feature, from its CHANGELOG entry or commit message)
FEATURE_FILES = {
    "tf_dpiter/keras/fast_clipping/rules/budget.py": (
        "e565f02", "CHANGELOG Fixed: a sequence layer's DP memory no longer holds the whole "
                   "batch's per-example temporaries at once (the memory budget of "
                   "fast_clipping/rules/budget.py)"),
    "tf_dpiter/data/python_source.py": (
        "1234946", "CHANGELOG Fixed: DP fit on arrays no longer slows every later step "
                   "(dp.data draws through python_source.python_dataset, not from_generator)"),
    "tf_dpiter/accounting/accountants.py": (
        "46b2aae", "commit: the accountant registry (register_accountant / "
                   "unregister_accountant / accountant_names)"),
    "tf_dpiter/auditing/mia_plotting.py": (
        "abb1d6d", "commit: TF Privacy membership-inference codelab parity (plot_roc_curve, "
                   "plot_by_epochs, plot_privacy_vs_accuracy, save_plot)"),
    "tf_dpiter/auditing/mia_results.py": (
        "abb1d6d", "commit: TF Privacy membership-inference codelab parity (results save/load, "
                   "calculate_pd_dataframe, PrivacyReportMetadata, AttackResultsCollection; "
                   "the results classes moved in from membership_inference.py are counted "
                   "too)"),
    "tf_dpiter/dp_query/summation.py": (
        "694546c", "CHANGELOG Fixed: the float32 sum over records moves by at most the "
                   "ledger's sensitivity (pinned summation orders and their rounding shrink; "
                   "Casacuberta et al., CCS 2022)"),
    "tf_dpiter/files.py": (
        "52f555c", "CHANGELOG Fixed (session 55): a DP model's checkpoint survives a crash "
                   "while the next one is written (model.save / save_weights replace the file "
                   "whole)"),
    "tf_dpiter/federated/server_journal.py": (
        "240b913", "CHANGELOG Fixed (session 45): a restarted federated server continues its "
                   "ledger from `ledger_journal=` (or refuses a journal of another recipe)"),
    "tf_dpiter/ledger/run_ids.py": (
        "e49f5bb", "CHANGELOG Fixed (session 34): ledgers merged by run identity, not by "
                   "content (two equal-recipe towers charged 12 samples for 22)"),
    "tf_dpiter/keras/optimizer/weight_fingerprints.py": (
        "634c8eb", "CHANGELOG Fixed (session 35): a DP model's weights changed outside its "
                   "DP optimizer are refused (a plain optimizer on a shared layer, set_weights)"),
    "tf_dpiter/keras/internals/total_records.py": (
        "3be180c", "CHANGELOG Fixed (session 36): private steps no longer stop on one "
                   "record's value (an id outside an Embedding's vocabulary, a label outside "
                   "the classes contribute zero; review R4 finding 10)"),
    "tf_dpiter/keras/optimizer/update_binding.py": (
        "2c84e61", "CHANGELOG Fixed (session 36): custom-loop updates bound to their "
                   "noised result (plain gradients after a dropped private result were "
                   "applied; review R5 finding 1)"),
    "tf_dpiter/keras/internals/data_writes.py": (
        "dce4fdf", "CHANGELOG Fixed: state written from the data found in the program and "
                   "refused (review R3, session 34)"),
    "tf_dpiter/keras/internals/row_provenance.py": (
        "7667066", "CHANGELOG Fixed (session 40): records combined before the private step "
                   "refused at the trace (keras/internals/row_provenance.py; review R9)"),
}

# path -> (commit that added it, why it is not a feature)
STRUCTURE_FILES = {
    "tf_dpiter/keras/internals/__init__.py": (
        "dd3b07a", "the keras/internals leaf sub-package (modules moved from keras/model)"),
    "tf_dpiter/keras/internals/keras_internals.py": (
        "dd3b07a", "the private-API wrappers moved from keras/model into the keras/internals "
                   "leaf (issue 41's leaf for the Keras internals)"),
    "tf_dpiter/keras/internals/runtime.py": (
        "dd3b07a", "moved from keras/optimizer/routing (oneDNN, XLA context, loss scale)"),
    "tf_dpiter/keras/optimizer/budget_copy.py": (
        "c08d74e", "dp_copy_for_budget moved out of keras/optimizer/budget.py (a cycle cut)"),
    "tf_dpiter/draw_discard/store_factory.py": (
        "701db6f", "make_store moved out of draw_discard/store.py (a cycle cut)"),
    "tf_dpiter/accounting/policy_accounting.py": (
        "46b2aae", "the policies' dp-accounting events moved out of the ledger (layering)"),
    "tf_dpiter/keras/optimizer/dp_config.py": (
        "8597f1e", "the frozen plan DPConfig / PerformanceFlags: the structure issue 41 asks "
                   "for (the optimizer's keywords build it)"),
    "tf_dpiter/keras/noise.py": (
        "8597f1e", "dp.keras.noise: the noise mechanisms as objects, issue 41's structure "
                   "(the string forms stay)"),
}


def _git(repo, *args):
  """stdout of `git -C repo args...` (text)."""
  return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                        text=True).stdout


def package_lines(repo, rev):
  """{path: lines} of the package's Python files at `rev`.

  Args:
    repo: the repository root (a path).
    rev: a git revision (commit, tag, branch).

  Returns:
    a dict from each tf_dpiter/**.py path to its line count (`len(text.splitlines())`).
  """
  names = [p for p in _git(repo, "ls-tree", "-r", "--name-only", rev, "--", PACKAGE).splitlines()
           if p.endswith(".py")]
  return {p: len(_git(repo, "show", f"{rev}:{p}").splitlines()) for p in names}


def added_files(repo, base, now):
  """The package files at `now` that are new since `base` (renames are not new).

  Args:
    repo: the repository root.
    base: the earlier revision.
    now: the later revision.

  Returns:
    a sorted list of paths (git's rename detection: a moved file keeps its history).
  """
  out = _git(repo, "diff", "-M", "--name-status", "--diff-filter=A", base, now, "--", PACKAGE)
  return sorted(line.split("\t")[-1] for line in out.splitlines()
                if line.split("\t")[-1].endswith(".py"))


def measure(repo, base=BASE, now="HEAD", features=None, structure=None):
  """The figures of the package at `base` and `now` (see the module docstring).

  Args:
    repo: the repository root.
    base: the earlier revision.
    now: the later revision.
    features: {path: (commit, feature)} of the files added for a new feature (default
      `FEATURE_FILES`).
    structure: {path: (commit, reason)} of the files added to restructure existing code
      (default `STRUCTURE_FILES`).

  Returns:
    a dict: base_lines, base_files, now_lines, now_files, feature_lines (a), the growth (b),
    equal_feature_lines, change (fraction of base_lines), and the per-file lists.
  """
  features = FEATURE_FILES if features is None else features
  structure = STRUCTURE_FILES if structure is None else structure
  before, after = package_lines(repo, base), package_lines(repo, now)
  added = added_files(repo, base, now)
  feature = {p: after[p] for p in added if p in features}
  restructure = {p: after[p] for p in added if p in structure and p not in features}
  unclassified = {p: after[p] for p in added if p not in features and p not in structure}
  base_lines, now_lines = sum(before.values()), sum(after.values())
  feature_lines = sum(feature.values())
  equal = now_lines - feature_lines
  return {
      "base": base, "now": now,
      "base_lines": base_lines, "base_files": len(before),
      "now_lines": now_lines, "now_files": len(after),
      "feature_lines": feature_lines,
      "other_growth": equal - base_lines,
      "equal_feature_lines": equal,
      "change": (equal - base_lines) / base_lines if base_lines else 0.0,
      "feature_files": feature,
      "structure_files": restructure,
      "unclassified_files": unclassified,
      "not_added": sorted(p for p in features if p not in feature),
  }


def main(argv=None):
  """Prints the figures for the revisions named on the command line.

  Args:
    argv: the arguments (default sys.argv[1:]).

  Returns:
    0.
  """
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repo", default=".", help="repository root (default .)")
  parser.add_argument("--base", default=BASE, help=f"earlier revision (default {BASE})")
  parser.add_argument("--now", default="HEAD", help="later revision (default HEAD)")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  args = parser.parse_args(argv)
  m = measure(pathlib.Path(args.repo), args.base, args.now)
  if args.json:
    print(json.dumps(m, indent=1))
    return 0
  print(f"base {m['base']}: {m['base_lines']:,} lines ({m['base_files']} files)")
  print(f"now  {m['now']}: {m['now_lines']:,} lines ({m['now_files']} files)")
  print(f"(a) files added for a new feature: {m['feature_lines']:,} lines")
  for p, n in m["feature_files"].items():
    commit, what = FEATURE_FILES.get(p, ("?", "?"))
    print(f"  {n:6,d}  {p}  [{commit}] {what}")
  print(f"(b) everything else: {m['other_growth']:+,} lines against the base; files added "
        "to restructure existing code:")
  for p, n in m["structure_files"].items():
    commit, why = STRUCTURE_FILES.get(p, ("?", "?"))
    print(f"  {n:6,d}  {p}  [{commit}] {why}")
  for p, n in m["unclassified_files"].items():
    print(f"  {n:6,d}  {p}  (unclassified: name it in FEATURE_FILES or STRUCTURE_FILES)")
  print(f"lines at equal features: {m['equal_feature_lines']:,} against {m['base_lines']:,} "
        f"({100 * m['change']:+.1f} %; issue 41's goal: -10 %)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
