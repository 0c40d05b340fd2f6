"""One benchmark on two revisions of tf_dpiter, alternated in one run (before/after figures).

  python benchmarks/compare_revisions.py --before REV --after REV [--rounds 3]
      -- benchmarks/fit_step_time.py --models cnn --steps 32 --rounds 1 --spe 1 --onednn 1

Each revision is checked out once into a temporary git worktree. The benchmark command (the
part after `--`, a script path relative to the repository root and its arguments) runs in a
child process per revision per round, the revisions alternating (before, after, before, ...)
so that both see the same machine load. Each child must print one JSON line last (as the
project's benchmarks do). Prints one JSON line: per revision the list of the children's JSON
results, and per numeric leaf of `results[*]` (for example `ratios_steady.dp_spe1`) the
median over rounds for each revision.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def _parse():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--before", required=True, help="git revision of the 'before' tree")
  p.add_argument("--after", default="HEAD", help="git revision of the 'after' tree")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("command", nargs=argparse.REMAINDER,
                 help="-- script.py args...: the benchmark, relative to the repository root")
  a = p.parse_args()
  if a.command[:1] == ["--"]:
    a.command = a.command[1:]
  if not a.command:
    p.error("give the benchmark command after --")
  return a


def _leaves(obj, prefix=""):
  """{dotted path: number} of the numeric leaves of a JSON value."""
  if isinstance(obj, dict):
    out = {}
    for k, v in obj.items():
      out.update(_leaves(v, f"{prefix}{k}."))
    return out
  if isinstance(obj, list):
    out = {}
    for i, v in enumerate(obj):
      out.update(_leaves(v, f"{prefix}{i}."))
    return out
  if isinstance(obj, (int, float)) and not isinstance(obj, bool):
    return {prefix[:-1]: obj}
  return {}


def main():
  a = _parse()
  root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                        text=True, check=True).stdout.strip()
  out = {"command": a.command, "rounds": a.rounds, "load_avg_start": os.getloadavg()}
  with tempfile.TemporaryDirectory() as tmp:
    trees = {}
    for name in ("before", "after"):
      rev = getattr(a, name)
      path = os.path.join(tmp, name)
      subprocess.run(["git", "-C", root, "worktree", "add", "-q", "--detach", path, rev],
                     check=True)
      trees[name] = path
      out[name + "_commit"] = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"],
                                             capture_output=True, text=True,
                                             check=True).stdout.strip()
    try:
      runs = {name: [] for name in trees}
      for _ in range(a.rounds):
        for name, path in trees.items():
          env = dict(os.environ, PYTHONPATH=path)
          res = subprocess.run([sys.executable] + a.command, cwd=path, env=env,
                               capture_output=True, text=True, check=True)
          runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    finally:
      for path in trees.values():
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", path],
                       check=False)
  out["runs"] = runs
  medians = {}
  for name, results in runs.items():
    per_leaf = {}
    for r in results:
      for k, v in _leaves(r.get("results", r)).items():
        per_leaf.setdefault(k, []).append(v)
    medians[name] = {k: statistics.median(v) for k, v in per_leaf.items()
                     if len(v) == len(results)}
  out["medians"] = medians
  out["load_avg_end"] = os.getloadavg()
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
