"""`python -m tf_dpiter.accounting <command> [args]`: the console scripts without installing.

Commands: compute_dp_sgd_privacy, compute_noise_from_budget, dp_ledger (its own subcommands
report, show, plot). `python -m tf_dpiter.accounting <command> --help` for each.
"""

import sys

from tf_dpiter.accounting import cli

COMMANDS = {
    "compute_dp_sgd_privacy": (cli.compute_dp_sgd_privacy_main,
                               "epsilon of DP-SGD from its hyperparameters (takes TF "
                               "Privacy's flags, e.g. --noused_microbatching)"),
    "compute_noise_from_budget": (cli.compute_noise_from_budget_main,
                                  "the noise multiplier meeting (epsilon, delta)"),
    "dp_ledger": (cli.dp_ledger_main,
                  "report | show | plot a saved privacy ledger JSON file"),
}

USAGE = ("usage: python -m tf_dpiter.accounting {" + ",".join(COMMANDS) + "} [args]\n\n"
         "Privacy accounting from the command line (the console scripts of the same names).\n\n"
         "commands:\n"
         + "".join(f"  {name:<27} {text}\n" for name, (_, text) in COMMANDS.items())
         + "\n`python -m tf_dpiter.accounting <command> --help` describes a command's "
         "arguments.\n")


def main(argv=None):
  """Runs the command named by argv[0] (None: sys.argv[1:]) with the rest of argv; returns the
  command's exit status, 0 for --help, 2 for a missing or unknown command."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
    return 0 if argv else 2
  name = argv[0].replace("-", "_")
  if name not in COMMANDS:
    print(USAGE, end="", file=sys.stderr)
    print(f"error: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}",
          file=sys.stderr)
    return 2
  return COMMANDS[name][0](argv[1:])


if __name__ == "__main__":
  sys.exit(main())
