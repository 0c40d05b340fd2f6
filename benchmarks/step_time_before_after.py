"""Step time of the DP train step before and after a change, in one run (issue 12).

  python benchmarks/step_time_before_after.py --before 5a340d3^ --repeats 5

Exports the `--before` commit's tree with `git archive` into a temporary directory and runs
that tree's benchmarks/step_time.py and this tree's, interleaved round-robin (so both see the
same machine load), for the CNN and the MLP in default mode, and in secure mode
(`--secure_mode`, this tree only when the older tree has no such flag). Each run is its own
process (median ms/step over --steps timed steps); the table reports the median over
--repeats runs, in milliseconds per step at batch --batch_size. One JSON line per row.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _export(commit, dest):
  """The tree of `commit` under dest (git archive | tar: no checkout of this work tree)."""
  archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT,
                           capture_output=True, check=True).stdout
  subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)


def _run(tree, model, clipping, secure, args):
  cmd = [sys.executable, os.path.join(tree, "benchmarks", "step_time.py"), "--model", model,
         "--mode", "dp", "--clipping", clipping, "--batch_size", str(args.batch_size),
         "--steps", str(args.steps), "--warmup", str(args.warmup)]
  if secure:
    cmd.append("--secure_mode")
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, timeout=1800)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode or not lines:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
  return json.loads(lines[-1])


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--before", required=True, help="git commit of the 'before' tree")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--steps", type=int, default=15)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--batch_size", type=int, default=256)
  p.add_argument("--clipping", default="auto")
  p.add_argument("--models", nargs="+", default=["cnn", "mlp"])
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    _export(args.before, tmp)
    with open(os.path.join(tmp, "benchmarks", "step_time.py")) as f:
      before_secure = "--secure_mode" in f.read()
    configs = []
    for model in args.models:
      for secure in (False, True):
        configs.append(("after", ROOT, model, secure))
        if before_secure or not secure:
          configs.append(("before", tmp, model, secure))
    times = {c[:1] + c[2:]: [] for c in configs}
    paths = {}
    for _ in range(args.repeats):
      for which, tree, model, secure in configs:
        out = _run(tree, model, args.clipping, secure, args)
        times[(which, model, secure)].append(out["ms_per_step"])
        paths[(which, model, secure)] = (out["clipping"], out["device"])
  for (which, model, secure), ts in times.items():
    clipping, device = paths[(which, model, secure)]
    print(json.dumps({"tree": which, "commit": args.before if which == "before" else "HEAD",
                      "model": model, "secure_mode": secure, "clipping": clipping,
                      "batch_size": args.batch_size, "ms_per_step_median": round(float(np.median(ts)), 2),
                      "runs_ms": ts, "device": device}))


if __name__ == "__main__":
  main()
