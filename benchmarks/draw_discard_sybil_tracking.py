"""Issue 39's two figures, on loopback with in-process servers (bounded: about a minute).

1. Predictions flipped against the number of sybil identities k. Three established honest
   tokens (first seen an hour before, simulated) make 12 honest updates; then k fresh sybil
   tokens each submit noiseless coherent steps (-a on every weight: each alone a plausible
   update) until refused, up to 10 each; k = 20 instances holding one model w* plus their
   initial spread, the default spec on 33 weights. Reported: accepted attack updates and the share of
   an evaluation set's positive predictions (under the average of the k instances before
   the attack) that the attack turned negative. "before": no cap on new identities (the
   default, as in the audit); "after": new_identity_share = 0.5. Without tokens, "before" is
   k addresses in k /24s (one budget each, as every address had before) and "after" k
   addresses in one /24 (one budget, sybil.budget_key).
2. Victims' steps recovered against honest traffic. Per round: h honest updates (distinct
   /24s), one victim update, then the tracker draws 10 times and keeps every instance;
   20 rounds; k = 4 instances. Recovered: a victim step d with two kept instances differing by exactly d.
   "before": draw_min_updates = 1 (Algorithm 2's draws); "after": the default m = 4.

  python benchmarks/draw_discard_sybil_tracking.py
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading

import numpy as np

from tf_dpiter.draw_discard import auth, client, client_lib, http_server, service
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard.cli import dense_spec

SPEC = dense_spec(33)  # epsilon ln 32, gamma 0.001: a = 0.001 (the defaults)
K = 20


class Server:
  """A DDMLService served on 127.0.0.1 by http_server.serve in a daemon thread."""

  def __init__(self, svc):
    self.svc, self.loop, ready = svc, asyncio.new_event_loop(), threading.Event()

    def run():
      asyncio.set_event_loop(self.loop)
      self.running = self.loop.run_until_complete(http_server.serve(svc, "127.0.0.1", 0))
      ready.set()
      self.loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    ready.wait(30)
    self.url = f"http://127.0.0.1:{self.running.port}"

  def call(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

  def seed_model(self, rng) -> None:
    """Adds one model w* (scores of std ~0.08 on the evaluation set) to every slot."""
    w = rng.normal(0.0, 0.05, SPEC.num_weights)
    w[-1] = -w[:-1].sum() / 2  # about half the predictions positive
    slots = self.call(self.svc.store.snapshot()).slots
    for i in range(K):
      self.call(self.svc.store.replace(i, slots[i] + w))

  def average(self) -> np.ndarray:
    return self.call(self.svc.store.snapshot()).slots.mean(axis=0)

  def stop(self):
    self.call(self.running.stop())
    self.loop.call_soon_threadsafe(self.loop.stop)


class Bound(client_lib.DDMLClient):
  """A client whose connections leave from `src` (127.0.0.0/8)."""

  def __init__(self, url, src, token=None):
    super().__init__(url, token=token, insecure=True, timeout=10.0)
    self._src = src

  def _connect(self):
    return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout,
                                      source_address=(self._src, 0))


def _submit(c, step_fn, rng):
  d = c.draw()
  try:
    c.submit(d, d.weights + step_fn(d, rng))
    return True
  except client_lib.DDMLError:
    return False


def _honest_step(d, rng):
  x = rng.random((8, SPEC.num_weights - 1))
  return client.spec_update(SPEC, d.weights, {"x": x}, (x.sum(1) > 8).astype(float),
                            rng=rng) - d.weights


def _flipped(before: np.ndarray, after: np.ndarray, x: np.ndarray) -> float:
  pos = x @ before > 0
  return float(np.mean(x[pos] @ after <= 0)) if pos.any() else 0.0


def sybils_tokens(k: int, share: float | None) -> dict:
  tokens = [f"tok-{i:03d}-0123456789abcdef" for i in range(k + 3)]
  svc = service.DDMLService(SPEC, K, store_lib.MemoryStore(), seed=0,
                            tokens=auth.TokenSet(tokens), new_identity_share=share)
  now = [0.0]
  if svc.admission.newcomers is not None:
    svc.admission.newcomers.clock = lambda: now[0]
  srv, rng = Server(svc), np.random.default_rng(k)
  try:
    srv.seed_model(np.random.default_rng(0))
    for i in range(15):
      if i == 3:
        now[0] = 3601.0
      with Bound(srv.url, "127.50.0.1", tokens[i % 3]) as c:
        _submit(c, _honest_step, rng)
    return _attack(srv, [(f"127.51.{i}.1", tokens[3 + i]) for i in range(k)], rng)
  finally:
    srv.stop()


def sybils_addresses(k: int, one_prefix: bool) -> dict:
  srv, rng = Server(service.DDMLService(SPEC, K, store_lib.MemoryStore(), seed=0)), \
      np.random.default_rng(k)
  try:
    srv.seed_model(np.random.default_rng(0))
    srcs = [(f"127.52.0.{i + 1}" if one_prefix else f"127.53.{i}.1", None) for i in range(k)]
    return _attack(srv, srcs, rng)
  finally:
    srv.stop()


def _attack(srv, sybils, rng) -> dict:
  x = np.hstack([rng.random((2000, SPEC.num_weights - 1)), np.ones((2000, 1))])
  w0, a, accepted = srv.average(), srv.svc.rule.step, 0
  for src, token in sybils:
    with Bound(srv.url, src, token) as c:
      for _ in range(10):
        if not _submit(c, lambda d, r: np.full(SPEC.num_weights, -a), rng):
          break
        accepted += 1
  return dict(accepted_attack_updates=accepted, flipped=round(_flipped(w0, srv.average(), x), 3))


def tracking(honest_per_round: int, m: int, rounds: int = 20) -> dict:
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0, draw_min_updates=m)
  srv, rng, seen, steps, n = Server(svc), np.random.default_rng(m), {}, [], 0
  try:
    with Bound(srv.url, "127.60.0.1") as tracker:
      for r in range(rounds):
        for _ in range(honest_per_round):
          with Bound(srv.url, f"127.{61 + n // 256}.{n % 256}.1") as c:
            _submit(c, _honest_step, rng)
          n += 1
        with Bound(srv.url, f"127.70.{r}.1") as v:
          d = v.draw()
          step = _honest_step(d, rng)
          v.submit(d, d.weights + step)
          steps.append(step)
        for _ in range(10):
          w = tracker.draw().weights
          seen[w.tobytes()] = w
  finally:
    srv.stop()
  vals = np.array(list(seen.values()))
  diffs = (vals[:, None, :] - vals[None, :, :]).reshape(-1, vals.shape[1])
  hits = sum(bool(np.any(np.all(np.abs(diffs - s) <= 1e-9 * (1 + np.abs(s)), axis=1)))
             for s in steps)
  return dict(recovered=hits, of=len(steps), distinct_draws=len(seen),
              stale_draws=svc.metrics.counter("draws_stale_total"))


def main():
  for k in (1, 2, 4, 8, 16, 32):
    print(json.dumps(dict(figure="sybils_tokens", k=k, before=sybils_tokens(k, None),
                          after=sybils_tokens(k, 0.5))), flush=True)
  for k in (1, 4, 16, 32):
    print(json.dumps(dict(figure="sybils_addresses", k=k,
                          before=sybils_addresses(k, one_prefix=False),
                          after=sybils_addresses(k, one_prefix=True))), flush=True)
  for h in (0, 1, 4, 16):
    print(json.dumps(dict(figure="tracking", honest_per_victim_update=h,
                          before=tracking(h, 1), after=tracking(h, 4))), flush=True)


if __name__ == "__main__":
  main()
