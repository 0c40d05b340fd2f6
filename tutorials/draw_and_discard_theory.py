"""Theorem 1 and Lemma 2 of Draw and Discard (Pihur et al. 2018) by simulation, with PNG plots.

Theorem 1 (Section III-D1): with N(0, k/2 sigma^2) initialization and client noise of
variance sigma^2, the intra-model variance stays k/2 sigma^2 (here over 10^5 updates, 300
independent servers). Writing back to the drawn instance instead makes it grow (Fig. 1).
Lemma 2 (Section IV-D): a share 1/k of the updates survives long-term (their descendants
take over all k instances); the rest are discarded.

  nice python tutorials/draw_and_discard_theory.py --updates 100000
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np

from tf_dpiter.draw_discard import privacy, simulate  # noqa: E402  pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--updates", type=int, default=100_000)
  ap.add_argument("--replicates", type=int, default=300)
  ap.add_argument("--ks", type=int, nargs="+", default=[5, 20])
  ap.add_argument("--lemma2-ks", type=int, nargs="+", default=[2, 3, 5, 10, 20, 50])
  ap.add_argument("--tracked", type=int, default=3000)
  ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "plots"))
  args = ap.parse_args()
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  os.makedirs(args.out, exist_ok=True)

  gamma, eps = 0.001, 1.0
  sigma = privacy.noise_std("laplace", gamma, eps)
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  print("Theorem 1: intra-model variance / (k/2 sigma^2) at 20 checkpoints "
        f"(sigma^2 = 8 gamma^2/eps^2, gamma={gamma}, eps={eps}; {args.replicates} servers)")
  for k in args.ks:
    for strategy, ax in (("draw_discard", axes[0]), ("same_instance", axes[1])):
      steps, var = simulate.variance_trajectory(k, sigma, args.updates, replicates=args.replicates,
                                                checkpoints=20, strategy=strategy,
                                                rng=np.random.default_rng(k))
      ratio = var.mean(axis=1) / (k / 2 * sigma**2)
      se = var.std(axis=1, ddof=1) / math.sqrt(args.replicates) / (k / 2 * sigma**2)
      ax.errorbar(steps, ratio, yerr=2 * se, label=f"k={k}", capsize=2)
      print(f"  {strategy:13s} k={k:3d}: ratio min {ratio.min():.3f} max {ratio.max():.3f} "
            f"mean {ratio.mean():.3f}; max |ratio-1|/SE = {np.max(np.abs(ratio - 1) / se):.2f}")
  axes[0].axhline(1.0, color="k", lw=0.8)
  axes[0].set_title("Draw and Discard: variance stays k/2 sigma^2 (Theorem 1)")
  axes[1].set_title("same-instance replace: variance grows")
  for ax in axes:
    ax.set_xlabel("updates")
    ax.set_ylabel("intra-model variance / (k/2 sigma^2)")
    ax.legend()
  fig.tight_layout()
  path = os.path.join(args.out, "draw_discard_theorem1.png")
  fig.savefig(path, dpi=90)
  print("wrote", path)

  print(f"\nLemma 2: share of updates surviving long-term ({args.tracked} tracked updates)")
  print("| k | simulated survival | 1/k | chain q_1 (discard) | 1-1/k |")
  print("|---|---|---|---|---|")
  sims = []
  for k in args.lemma2_ks:
    s = simulate.survival_share(k, args.tracked, rng=np.random.default_rng(100 + k))
    sims.append(s)
    print(f"| {k} | {s:.4f} | {1 / k:.4f} | {privacy.discard_probability_chain(k):.4f} | {1 - 1 / k:.4f} |")
  fig, ax = plt.subplots(figsize=(5, 4))
  ks = np.array(args.lemma2_ks)
  se = np.sqrt((1 / ks) * (1 - 1 / ks) / args.tracked)
  ax.errorbar(ks, sims, yerr=2 * se, fmt="o", label="simulation (+-2 binomial SE)")
  kk = np.linspace(ks.min(), ks.max(), 200)
  ax.plot(kk, 1 / kk, label="1/k (Lemma 2)")
  ax.set_xscale("log"); ax.set_yscale("log")
  ax.set_xlabel("k"); ax.set_ylabel("share of updates surviving")
  ax.legend()
  fig.tight_layout()
  path = os.path.join(args.out, "draw_discard_lemma2.png")
  fig.savefig(path, dpi=90)
  print("wrote", path)
  print()
  privacy.print_privacy_statement(math.log(32), 20, 1000)


if __name__ == "__main__":
  main()
