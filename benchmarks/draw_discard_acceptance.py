"""The bounded-influence acceptance rule: honest false rejections and attacks (no HTTP).

Runs the service's AcceptanceRule on a simulated k-instance store with the service's
history (the last H replaced instances are candidates too):

  frr      --delay concurrent honest clients (Algorithm 1 on random logistic data;
           --noise-only: a zero gradient): each draws, then submits after about `delay`
           other updates landed (asynchrony), >= 10,000 updates per size.
  attacks  from the same start, N attacker submits and nothing else:
             collapse-average  submit the average of the k instances
             collapse-copy     submit a copy of a drawn instance
             collapse-min      drawn instance + the smallest Laplace noise that passes
             ratchet           drawn + the largest coherent shift that passes (all weights)
             takeover          best candidate towards a far target + largest shift
             one-weight        one weight pushed to the per-weight limit, noise elsewhere
           and N honest clients whose clipped gradient all points the same way (the most
           N honest clients move the average), for comparison. Reports acceptance, the
           mean shift of the average (units of the step a = gamma*clip) and the
           instances' spread before/after.

  python benchmarks/draw_discard_acceptance.py frr --weights 387 7850 --updates 10000
  python benchmarks/draw_discard_acceptance.py attacks --weights 387 --submits 300
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import time

import numpy as np

from tf_dpiter.draw_discard import acceptance, client, privacy, server
from tf_dpiter.draw_discard.cli import dense_spec


class Sim:
  """k instances, a replaced-instance history and the rule."""

  def __init__(self, p, k=20, history=256, alpha=1e-3, seed=0, centre_factor=36.0):
    self.spec = dense_spec(p)
    var = privacy.noise_std("laplace", self.spec.gamma, self.spec.epsilon, 1.0) ** 2
    std = math.sqrt(privacy.init_variance(k, var))
    self.rule = acceptance.AcceptanceRule(self.spec, alpha=alpha, spread_std=std,
                                          centre_factor=centre_factor)
    self.rng = np.random.default_rng(seed)
    self.slots = server.initial_instances(k, p, 0.0, std, self.rng)
    self.hist = collections.deque(maxlen=history)
    self.k = k

  def candidates(self):
    return np.concatenate([self.slots, np.array(self.hist)]) if self.hist else self.slots

  def submit(self, u):
    d = self.rule.check(u, self.candidates(), self.slots.mean(axis=0), self.k)
    if d.accepted:
      i = self.rng.integers(self.k)
      self.hist.appendleft(self.slots[i].copy())
      self.slots[i] = u
    return d

  def honest(self, w, direction=None, noise_only=False):
    p = self.spec.num_weights
    if noise_only:  # Algorithm 1 with a zero gradient: the spread grows fastest
      b = self.rule.scale
      return w + b * (self.rng.standard_exponential(p) - self.rng.standard_exponential(p))
    x = self.rng.random((10, p - 1))
    y = self.rng.integers(0, 2, 10) if direction is None else np.full(10, direction)
    return client.spec_update(self.spec, w, {"x": x}, y, rng=self.rng)


def false_rejections(p, updates, delay, seed=0, noise_only=False):
  """`delay` concurrent clients: each submits after about `delay` other updates landed.

  The pending draws form a queue; the next submit is one of the 8 oldest (jitter), so an
  update's draw-to-submit distance is between delay - 8 and delay + 8 updates.
  """
  sim = Sim(p, seed=seed)
  pending = [sim.slots[sim.rng.integers(sim.k)].copy() for _ in range(delay)]
  rejected, ages, t0 = collections.Counter(), [], time.time()
  born = list(range(-delay, 0))
  for done in range(updates):
    i = 0 if done - born[0] >= delay + 8 else int(sim.rng.integers(min(8, len(pending))))
    drawn, t = pending.pop(i), born.pop(i)
    ages.append(done - t)
    d = sim.submit(sim.honest(drawn, noise_only=noise_only))
    if not d.accepted:
      rejected[d.reason] += 1
    pending.append(sim.slots[sim.rng.integers(sim.k)].copy())
    born.append(done)
  n_rej = sum(rejected.values())
  return dict(weights=p, k=sim.k, updates=updates, clients=delay, max_age=max(ages),
              history=sim.hist.maxlen, noise_only=noise_only,
              centre_factor=sim.rule.centre_factor, alpha=sim.rule.alpha, rejected=n_rej,
              rate=n_rej / updates, reasons=dict(rejected), seconds=round(time.time() - t0, 1))


def _spread(sim):
  return float(sim.slots.std(axis=0, ddof=1).mean())


def _attack_update(sim, kind, target):
  rule, rng = sim.rule, sim.rng
  a, s, p = rule.step, rule.scale, rule.p
  w = sim.slots[rng.integers(sim.k)].copy()
  if kind == "collapse-average":
    return sim.slots.mean(axis=0)
  if kind == "collapse-copy":
    return w
  if kind == "collapse-min":
    for lam in np.linspace(0.05, 1.0, 20):
      u = w + lam * s * (rng.standard_exponential(p) - rng.standard_exponential(p))
      if rule.check(u, sim.candidates(), sim.slots.mean(axis=0), sim.k).accepted:
        return u
    return u
  shift = a + s * rule.upper / p * (1 - 1e-9)
  if kind == "ratchet":
    return w + shift
  if kind == "takeover":  # chain from the candidate nearest the target, if the rule allows
    c = sim.candidates()
    for j in np.argsort(np.abs(c - target).sum(axis=1)):
      u = c[j] + np.sign(target - c[j]) * shift
      if rule.check(u, c, sim.slots.mean(axis=0), sim.k).accepted:
        return u
    return w + shift
  if kind == "one-weight":
    u = sim.honest(w)
    u[0] = w[0] + rule.linf * (1 - 1e-9)
    return u
  raise ValueError(f"unknown attack {kind!r}")


def attack(p, kind, submits, seed=0):
  sim = Sim(p, seed=seed)
  a = sim.rule.step
  avg0, spread0 = sim.slots.mean(axis=0), _spread(sim)
  target = avg0 + 1e3
  accepted = 0
  for _ in range(submits):
    if kind == "honest-coherent":
      u = sim.honest(sim.slots[sim.rng.integers(sim.k)].copy(), direction=0)
      d = sim.submit(u)
    else:
      d = sim.submit(_attack_update(sim, kind, target))
    accepted += d.accepted
  moved = sim.slots.mean(axis=0) - avg0
  honest_after = sum(sim.submit(sim.honest(sim.slots[sim.rng.integers(sim.k)].copy())).accepted
                     for _ in range(200))
  return dict(attack=kind, weights=p, submits=submits, accepted=accepted,
              mean_shift_in_steps=float(moved.mean() / a),
              weight0_shift_in_steps=float(moved[0] / a),
              max_abs_shift_in_steps=float(np.abs(moved).max() / a),
              spread_before=spread0, spread_after=_spread(sim),
              honest_accepted_after=f"{honest_after}/200")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("what", choices=("frr", "attacks"))
  ap.add_argument("--weights", type=int, nargs="+", default=[387, 7850])
  ap.add_argument("--updates", type=int, default=10000)
  ap.add_argument("--delay", type=int, default=64,
                  help="concurrent clients = updates between a draw and its submit (+-8)")
  ap.add_argument("--submits", type=int, default=300)
  ap.add_argument("--noise-only", action="store_true",
                  help="frr: honest updates without a gradient (noise only)")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  for p in args.weights:
    if args.what == "frr":
      print(json.dumps(false_rejections(p, args.updates, args.delay, args.seed,
                                        args.noise_only)), flush=True)
      continue
    for kind in ("honest-coherent", "collapse-average", "collapse-copy", "collapse-min",
                 "ratchet", "takeover", "one-weight"):
      print(json.dumps(attack(p, kind, args.submits, args.seed)), flush=True)


if __name__ == "__main__":
  main()
