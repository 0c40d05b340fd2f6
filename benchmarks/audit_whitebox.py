"""White-box DP-SGD audit with many trials: claimed ε in {1, 2, 4, 8} beside the bound.

Dirac canaries go through the real tf_dpiter.keras DP step (Poisson batches, clipping, noise,
ledger) on a small synthetic task; every step is an independent one-step trial for each
canary coordinate, so m_in * T member trials and m_out * T non-member trials audit the
one-step claim (dp_accounting PLD). Also: noise 0, and the halved-sensitivity claim of a
replace-one run.

  python benchmarks/audit_whitebox.py                       # q = 1, m = 4000, T = 200
  python benchmarks/audit_whitebox.py --q 0.5 --steps 400
  python benchmarks/audit_whitebox.py --soundness_reps 1000 # also: GDP soundness rate

Prints one line per experiment and a JSON summary last.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter.auditing as audit  # noqa: E402

DELTA = 1e-5


def calibrate_z(q, target, delta=DELTA):
  """z whose one-step PLD ε is just below target (bisection on dp_accounting)."""
  lo, hi = 0.1, 50.0
  for _ in range(30):
    mid = (lo * hi) ** 0.5
    lo, hi = (mid, hi) if audit.claimed_epsilon(q, mid, 1, delta) > target else (lo, mid)
  return hi


def run(z, m, steps, q, **kw):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(256, 8)).astype(np.float32)
  y = rng.integers(0, 3, 256)
  base = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
  return audit.run_whitebox_audit(base, x, y, 3, num_canaries=m, noise_multiplier=z,
                                  sampling_probability=q, steps=steps, delta=DELTA,
                                  ledger_accountant=None, **kw)


def soundness(reps, n, mus=(0.5, 1.0, 2.0)):
  out = {}
  for mu in mus:
    true = audit.gdp_epsilon(mu, DELTA)
    rng = np.random.default_rng(int(mu * 1000))
    b = np.array([audit.epsilon_lower_bound(rng.normal(mu, 1, n), rng.normal(0, 1, n), DELTA)
                  for _ in range(reps)])
    out[mu] = {"true_epsilon": true, "violations": int(np.sum(b > true)), "reps": reps,
               "mean_bound": float(b.mean())}
    print(f"GDP mu={mu}: true eps {true:.3f}; bound > true in {out[mu]['violations']}/{reps} "
          f"repetitions (n={n} per class); mean bound {b.mean():.3f}", flush=True)
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--q", type=float, default=1.0)
  p.add_argument("--canaries", type=int, default=4000)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--targets", default="1,2,4,8")
  p.add_argument("--soundness_reps", type=int, default=0)
  p.add_argument("--soundness_n", type=int, default=1000)
  args = p.parse_args()
  summary = {"args": vars(args), "claims": []}
  for target in [float(t) for t in args.targets.split(",")]:
    t0 = time.time()
    z = calibrate_z(args.q, target)
    r = run(z, args.canaries, args.steps, args.q)
    claim = r.step_claimed_epsilon()
    row = {"target": target, "z": z, "step_claim": claim, "step_bound": r.step_bound.epsilon,
           "ratio": r.step_bound.epsilon / claim,
           "member_trials": int(r.included.sum()) * r.steps,
           "nonmember_trials": int((~r.included).sum()) * r.steps,
           "run_claim_pld": r.claimed_epsilon(), "run_bound": r.run_bound.epsilon,
           "seconds": round(time.time() - t0, 1)}
    summary["claims"].append(row)
    print(f"claim {claim:.3f} (z={z:.4f}, q={args.q}): bound {row['step_bound']:.3f} = "
          f"{row['ratio']:.2f} of the claim from {row['member_trials']}/{row['nonmember_trials']} "
          f"trials; run of {r.steps} steps: claim {row['run_claim_pld']:.3f}, bound "
          f"{row['run_bound']:.3f} ({row['seconds']} s)", flush=True)
  r = run(0.0, 4096, 64, args.q, p_in=1 / 32)
  summary["noise0"] = {"step_bound": r.step_bound.epsilon, "run_bound": r.run_bound.epsilon}
  print(f"noise 0: step bound {r.step_bound.epsilon:.3f}, run bound {r.run_bound.epsilon:.3f}",
        flush=True)
  z = 1.6
  r = run(z, 1000, 80, 1.0, neighbouring="replace")
  wrong = audit.claimed_epsilon(1.0, z, 1, DELTA, sensitivity=1.0)
  right = audit.claimed_epsilon(1.0, z, 1, DELTA, sensitivity=2.0)
  summary["halved_sensitivity"] = {"wrong_claim": wrong, "bound": r.step_bound.epsilon,
                                   "correct_claim": right}
  print(f"replace-one run, z={z}: claim with sensitivity S (wrong) {wrong:.3f} < audited "
        f"{r.step_bound.epsilon:.3f} <= claim with 2S {right:.3f}", flush=True)
  if args.soundness_reps:
    summary["soundness"] = soundness(args.soundness_reps, args.soundness_n)
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
