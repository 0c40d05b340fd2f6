"""Poisoning within the acceptance rule: predictions flipped vs attacker submits, before/after.

Runs the real service objects in process (service.DDMLService on a memory store: draw
tickets, the per-submit acceptance rule, rebasing, the influence budget), without HTTP,
with the influence budget on a simulated clock. The k instances start at a target model
w* plus Theorem 1's spread (Pihur et al., "Differentially-Private Draw and Discard Machine
Learning", Section IV); an evaluation set is labelled by w*.

Attacker (issue 29, finding 3): one identity (or --identities of them, round robin) with
valid tickets submits "drawn instance - a on every weight" without noise, 2 submits per
simulated second (the README's submit quota). Honest traffic (--honest per attacker submit,
each from a fresh identity, as one-shot mobile clients): Algorithm 1 on records labelled by
w*. Reported: the share of the evaluation points w* predicts positive that the model
(average of the k instances) predicts negative, after n attacker submits.

  before: the influence budget without decay or rate cap (influence_steps=None)
  after:  the defaults (at most 8 decayed updates per identity, half-life 300 s)

  python benchmarks/dd_poisoning.py --seeds 3 [--plot benchmarks/plots/dd_poisoning.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from tf_dpiter.draw_discard import client, parsing, service
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard.cli import dense_spec

CHECKPOINTS = (0, 25, 50, 75, 100, 175, 250, 400)


class SimClock:
  """The influence budget's clock: simulated seconds."""

  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


async def _setup(p, k, seed, after):
  spec = dense_spec(p)
  kw = {} if after else dict(influence_steps=None, influence_half_life_s=None)
  svc = service.DDMLService(spec, k, store_lib.MemoryStore(), seed=seed, **kw)
  await svc.startup()
  svc.budget.clock = clock = SimClock()
  rng = np.random.default_rng(seed)
  w_star = rng.normal(0.0, np.sqrt(3.0 / p), p)
  x_eval = rng.random((2000, p - 1))
  w_star[-1] = -np.median(x_eval @ w_star[:-1])  # the intercept: half the points positive
  rows = svc.store._rows  # pylint: disable=protected-access  (benchmark: start at w*)
  rows[:k] = w_star + svc.initial_instances()
  return svc, clock, rng, w_star, x_eval


def _positive(w, x):
  return x @ w[:-1] + w[-1] > 0


async def _submit(svc, identity, make):
  h, ticket = await svc.draw_for(identity)
  sub = parsing.Submission(weights=make(h), drawn=h, ticket=ticket)
  try:
    await svc.store_ticketed(identity, sub)
    return True
  except parsing.RequestError:
    return False


async def run(p, k, seed, after, honest_per_attack, identities, submits):
  svc, clock, rng, w_star, x_eval = await _setup(p, k, seed, after)
  a = svc.rule.step
  pos = _positive(w_star, x_eval)
  curve, accepted = {}, 0
  for n in range(submits + 1):
    if n in CHECKPOINTS:
      avg = (await svc.store.snapshot()).slots.mean(axis=0)
      curve[n] = round(float((pos & ~_positive(avg, x_eval)).sum() / pos.sum()), 3)
    if n == submits:
      break
    for j in range(honest_per_attack):
      clock.t += 0.5 / (honest_per_attack + 1)
      x = rng.random((10, p - 1))
      y = (rng.random(10) < 1 / (1 + np.exp(-(x @ w_star[:-1] + w_star[-1])))).astype(float)
      await _submit(svc, f"honest-{n}-{j}",
                    lambda h, x=x, y=y: client.spec_update(svc.spec, h, {"x": x}, y, rng=rng))
    clock.t += 0.5 / (honest_per_attack + 1)
    accepted += await _submit(svc, f"mallory-{n % identities}", lambda h: h - a)
  await svc.shutdown()
  return dict(config="after" if after else "before", identities=identities,
              honest_per_attack=honest_per_attack, seed=seed, attacker_accepted=accepted,
              flipped=curve)


def _plot(results, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  for key, curves in results.items():
    xs = CHECKPOINTS
    ys = [np.median([c[n] for c in curves]) for n in xs]
    ax.plot(xs, ys, marker="o", label=key)
  ax.set_xlabel("attacker submits (2/s)")
  ax.set_ylabel("positive predictions flipped (median over seeds)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("--weights", type=int, default=387)
  ap.add_argument("--k", type=int, default=20)
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--honest", type=int, default=10, help="honest updates per attacker submit")
  ap.add_argument("--submits", type=int, default=400)
  ap.add_argument("--plot", default=None, help="PNG path for the figure (needs matplotlib)")
  args = ap.parse_args(argv)
  t0 = time.time()
  results = {}
  for after in (False, True):
    for honest, identities in ((0, 1), (args.honest, 1), (0, 5)):
      if identities > 1 and not after:
        continue
      key = (f"{'after' if after else 'before'}, {identities} identit"
             f"{'y' if identities == 1 else 'ies'}, {honest} honest/attack")
      for seed in range(args.seeds):
        r = asyncio.run(run(args.weights, args.k, seed, after, honest, identities, args.submits))
        print(json.dumps(r), flush=True)
        results.setdefault(key, []).append(r["flipped"])
  print("\n| configuration | " + " | ".join(f"n={n}" for n in CHECKPOINTS) + " |")
  print("|---|" + "---|" * len(CHECKPOINTS))
  for key, curves in results.items():
    med = [np.median([c[n] for c in curves]) if n in curves[0] else float("nan")
           for n in CHECKPOINTS]
    print(f"| {key} | " + " | ".join(f"{100 * m:.0f}%" for m in med) + " |")
  print(f"\n({args.seeds} seeds, median; {args.weights} weights, k={args.k}; "
        f"{time.time() - t0:.0f} s)")
  if args.plot:
    _plot(results, args.plot)


if __name__ == "__main__":
  main()
