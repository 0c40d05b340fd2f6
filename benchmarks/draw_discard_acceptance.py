"""Acceptance rule + draw tickets + influence budget: honest false rejections and attacks (no HTTP).

Simulates the service's decision path with draw tickets (the default): every submit
names the instance the server drew for it (a uniformly random slot), the step u - h is
tested against that instance (AcceptanceRule.check_step) and the submitter's cumulative
step against N honest clients' envelope (influence.InfluenceBudget); an accepted update
replaces a uniformly random slot.

  frr      honest clients (one identity each), round robin, Algorithm 1 on random
           logistic data (--noise-only: zero gradient; --coherent: every label 0, so all
           steps point the same way): refusals by reason over --updates updates.
  attacks  from the Theorem 1 start, N submits of one attacker identity and no other traffic
           (--tokens T: the attacker spreads them over T identities):
             honest-coherent   N honest clients (N identities), every label 0 (reference)
             honest-max        N honest clients whose clipped gradient is -1 in every weight
                               (step +a everywhere, plus Laplace noise): the honest maximum
             collapse-average  submit the average of the k instances
             collapse-copy     submit a copy of the drawn instance
             collapse-min      drawn instance + the smallest Laplace noise that passes
             ratchet           drawn + the largest constant shift of all weights that passes
                               (per-submit tests and the budget; the attacker knows both)
             ratchet-select4   the same from the best (largest mean) of 4 draws (discarding
                               3: what a draw quota of 4x the submit quota allows)
             chain             claim its own last accepted update as the drawn instance
                               (with the ticket of a real draw): refused, the ticket's hash
                               names the served instance
             one-weight        weight 0 pushed as far as passes, Laplace noise elsewhere
             one-weight-select4  the same from the draw with the largest weight 0 of 4
           Reports acceptance, the shift of the average (in steps a = gamma*clip): mean over
           weights and weight 0, and "ratio": shift / (N a / k), N a / k being what N honest
           clients whose clipped gradients all point the same way move it in expectation;
           "step_term_*_ratio": the same for (sum of accepted steps) / k, the expectation of
           the shift (the rest, (h' - replaced)/k per update, has mean zero; use --seeds).

  python benchmarks/draw_discard_acceptance.py frr --weights 387 7850 --updates 10000
  python benchmarks/draw_discard_acceptance.py attacks --weights 387 7850 --submits 300 --seeds 3
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import time

import numpy as np

from tf_dpiter.draw_discard import acceptance, client, influence, privacy, server
from tf_dpiter.draw_discard.cli import dense_spec

ATTACKS = ("honest-coherent", "honest-max", "collapse-average", "collapse-copy", "collapse-min", "ratchet",
           "ratchet-select4", "chain", "one-weight", "one-weight-select4")


class Sim:
  """k instances, the rule, the influence budget and ticket semantics (served instance known)."""

  def __init__(self, p, k=20, alpha=1e-3, budget_alpha=1e-3, seed=0, rebase=True):
    self.spec = dense_spec(p)
    var = privacy.noise_std("laplace", self.spec.gamma, self.spec.epsilon, 1.0) ** 2
    std = math.sqrt(privacy.init_variance(k, var))
    self.rule = acceptance.AcceptanceRule(self.spec, alpha=alpha)
    # the undecayed envelope, no rate cap (no clock here; dd_poisoning.py measures the cap)
    self.budget = influence.InfluenceBudget(self.rule, budget_alpha, max_steps=None,
                                            half_life_s=None)
    self.rng = np.random.default_rng(seed)
    self.slots = server.initial_instances(k, p, 0.0, std, self.rng)
    self.k, self.p, self.rebase = k, p, rebase

  def draw(self) -> np.ndarray:
    return self.slots[self.rng.integers(self.k)].copy()

  def passes(self, identity, h, u) -> str:
    """The refusal reason of submitting u from served h (nothing changes), or ""."""
    d = self.rule.check_step(u, h)
    if not d.accepted:
      return d.reason
    reason = self.budget.reserve(identity, u - h)
    if not reason:
      self.budget.release(identity, u - h)
    return reason

  def submit(self, identity, h, u, served=None) -> str:
    """Submits u drawn from h; `served` (default h) is what the server drew for the ticket."""
    if served is not None and not np.array_equal(served, h):
      return "invalid_ticket"
    d = self.rule.check_step(u, h)
    if not d.accepted:
      return d.reason
    reason = self.budget.reserve(identity, u - h)
    if not reason:
      new = self.draw() + (u - h) if self.rebase else u
      self.slots[self.rng.integers(self.k)] = new
    return reason

  def honest(self, w, direction=None, noise_only=False):
    p = self.p
    if noise_only:
      return w + self.laplace(p)
    x = self.rng.random((10, p - 1))
    y = self.rng.integers(0, 2, 10) if direction is None else np.full(10, direction)
    return client.spec_update(self.spec, w, {"x": x}, y, rng=self.rng)

  def laplace(self, n):
    b = self.rule.scale
    return b * (self.rng.standard_exponential(n) - self.rng.standard_exponential(n))


def false_rejections(p, updates, clients, seed=0, noise_only=False, coherent=False):
  """`clients` honest identities submit in turn; each update is tested against its draw."""
  sim = Sim(p, seed=seed)
  rejected, t0 = collections.Counter(), time.time()
  for i in range(updates):
    h = sim.draw()
    reason = sim.submit(f"c{i % clients}", h, sim.honest(h, 0 if coherent else None, noise_only))
    if reason:
      rejected[reason] += 1
  n_rej = sum(rejected.values())
  return dict(weights=p, k=sim.k, updates=updates, clients=clients,
              updates_per_client=updates // clients, noise_only=noise_only, coherent=coherent,
              alpha=sim.rule.alpha, budget_alpha=sim.budget.alpha, rejected=n_rej,
              rate=n_rej / updates, reasons=dict(rejected), seconds=round(time.time() - t0, 1))


def _largest(sim, identity, h, make, hi, smallest=False):
  """Largest (or smallest) c in [0, hi] with make(c) passing: a grid of 200 points, then
  bisection next to the best passing one (the rule is public, so an attacker can do this).
  Returns make(c), or make(hi) when nothing on the grid passes."""
  grid = np.linspace(0.0, hi, 201)
  ok = [sim.passes(identity, h, make(c)) == "" for c in grid]
  if not any(ok):
    return make(hi)
  i = (ok.index(True) if smallest else len(ok) - 1 - ok[::-1].index(True))
  good, bad = grid[i], grid[i - 1] if smallest else grid[min(i + 1, 200)]
  if good == bad:
    return make(good)
  for _ in range(30):
    mid = 0.5 * (good + bad)
    good, bad = (mid, bad) if sim.passes(identity, h, make(mid)) == "" else (good, mid)
  return make(good)


def _pick(sim, select, key):
  draws = [sim.draw() for _ in range(select)]
  return max(draws, key=key)


def _attack_update(sim, kind, identity, last):
  """(claimed drawn instance, update, served instance) of one attacker submit."""
  rule, p = sim.rule, sim.p
  if kind.startswith("ratchet"):
    h = _pick(sim, 4 if kind.endswith("select4") else 1, lambda w: w.mean())
    return h, _largest(sim, identity, h, lambda c: h + c, 2 * rule.linf), h
  if kind.startswith("one-weight"):
    h = _pick(sim, 4 if kind.endswith("select4") else 1, lambda w: w[0])
    noise = sim.laplace(p)

    def make(c):
      u = h + noise
      u[0] = h[0] + c
      return u
    return h, _largest(sim, identity, h, make, 2 * rule.linf), h
  h = sim.draw()
  if kind == "collapse-average":
    return h, sim.slots.mean(axis=0), h
  if kind == "collapse-copy":
    return h, h.copy(), h
  if kind == "collapse-min":
    noise = sim.laplace(p) / rule.scale
    return h, _largest(sim, identity, h, lambda c: h + c * noise * rule.scale, 1.0, True), h
  if kind == "chain":
    base = h if last is None else last  # claims its own last update as the drawn instance
    return base, base + rule.step + sim.laplace(p), h
  raise ValueError(f"unknown attack {kind!r}")


def attack(p, kind, submits, seed=0, tokens=1, rebase=True):
  sim = Sim(p, seed=seed, rebase=rebase)
  a = sim.rule.step
  avg0 = sim.slots.mean(axis=0)
  spread0 = float(sim.slots.std(axis=0, ddof=1).mean())
  accepted, reasons, last = 0, collections.Counter(), None
  for t in range(submits):
    identity = f"attacker{t % tokens}"
    if kind.startswith("honest"):
      h = sim.draw()
      u = (sim.honest(h, direction=0) if kind == "honest-coherent"
           else h + a + sim.laplace(p))
      reason = sim.submit(f"honest{t}", h, u)
    else:
      h, u, served = _attack_update(sim, kind, identity, last)
      reason = sim.submit(identity, h, u, served)
      last = u if not reason else last
    accepted += not reason
    if reason:
      reasons[reason] += 1
  moved = sim.slots.mean(axis=0) - avg0
  honest_max = submits * a / sim.k
  steps = np.zeros(p)  # the step term sum_t d_t / k the submitters control (influence.py)
  for ident in {f"attacker{t % tokens}" for t in range(submits)}:
    steps += sim.budget.state(ident)[1]
  if kind.startswith("honest"):
    steps = sum(sim.budget.state(f"honest{t}")[1] for t in range(submits))
  honest_after = 0
  for i in range(200):
    h = sim.draw()
    honest_after += not sim.submit(f"later{i}", h, sim.honest(h))
  return dict(attack=kind, weights=p, submits=submits, tokens=tokens, seed=seed, rebase=rebase,
              accepted=accepted, reasons=dict(reasons),
              mean_shift_in_steps=float(moved.mean() / a),
              weight0_shift_in_steps=float(moved[0] / a),
              honest_max_in_steps=honest_max / a,
              mean_ratio=float(moved.mean() / honest_max),
              weight0_ratio=float(moved[0] / honest_max),
              step_term_mean_ratio=float(steps.mean() / sim.k / honest_max),
              step_term_weight0_ratio=float(steps[0] / sim.k / honest_max),
              spread_after_over_before=float(sim.slots.std(axis=0, ddof=1).mean()) / spread0,
              honest_accepted_after=f"{honest_after}/200")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("what", choices=("frr", "attacks"))
  ap.add_argument("--weights", type=int, nargs="+", default=[387, 7850])
  ap.add_argument("--updates", type=int, default=10000)
  ap.add_argument("--clients", type=int, default=64, help="frr: honest identities")
  ap.add_argument("--submits", type=int, default=300)
  ap.add_argument("--tokens", type=int, default=1, help="attacks: attacker identities")
  ap.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
  ap.add_argument("--noise-only", action="store_true", help="frr: zero gradient")
  ap.add_argument("--coherent", action="store_true", help="frr: all labels 0")
  ap.add_argument("--no-rebase", action="store_true",
                  help="attacks: store u itself (Algorithm 2) instead of the rebased step")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--seeds", type=int, default=1, help="attacks: repetitions (seed, seed+1, ...)")
  args = ap.parse_args(argv)
  for p in args.weights:
    if args.what == "frr":
      print(json.dumps(false_rejections(p, args.updates, args.clients, args.seed,
                                        args.noise_only, args.coherent)), flush=True)
      continue
    for kind in args.attacks:
      for s in range(args.seed, args.seed + args.seeds):
        print(json.dumps(attack(p, kind, args.submits, s, args.tokens, not args.no_rebase)),
              flush=True)


if __name__ == "__main__":
  main()
