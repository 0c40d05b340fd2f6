"""The draw-tracking attack on adversary II's assumption, with and without quotas.

One TLS+token server (memory store). --honest paced honest clients (one token each,
--honest-rate updates/s each) keep the instances moving; a victim (its own token) makes
--victim-updates updates; an attacker (one token) draws as fast as its quota allows,
honouring 429 Retry-After, and remembers every instance it saw. For each victim update
u with pre-image h (the instance the victim drew), the attacker identifies the pre-image
when it saw u and its nearest seen instance to u (L1, excluding u) is h: adversary I's
view. The attacker is granted knowledge of which instance is the victim's update.

  python benchmarks/draw_discard_draw_tracking.py --quota 2 --no-quota
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

import draw_discard_common as common


async def _honest(conn, rng, b, stop_at, period):
  while time.perf_counter() < stop_at:
    t = time.perf_counter()
    try:
      await common.one_update(conn, rng, b)
    except ConnectionError:
      pass
    await asyncio.sleep(max(0.0, period - (time.perf_counter() - t)))


async def _victim(conn, rng, b, n, period, log):
  for _ in range(n):
    st, h, ticket, _ = await common.draw(conn)
    if st == 200:
      body, headers, step = common.submit_args(h, ticket, rng, b)
      st2, _, _ = await conn.request("POST", "/v1/submit", body, headers)
      if st2 == 200:
        log.append((h.copy(), step))
    await asyncio.sleep(period)


async def _attacker(conn, stop_at, seen, counts):
  while time.perf_counter() < stop_at:
    st, data, hdrs = await conn.request("GET", "/v1/draw?encoding=raw")
    if st == 200:
      seen[data] = None
      counts["draws"] += 1
    elif st == 429:
      counts["refused"] += 1
      await asyncio.sleep(min(float(hdrs.get("retry-after", 1)), 1.0) / 4)


def _identified(log, seen) -> int:
  """Victim steps the attacker recovers: a seen instance v whose nearest other seen
  instance g has v - g equal to the victim's step (the server stores h' + step, h' the
  instance it drew at submit time, so knowing h' is knowing the pre-image)."""
  if not seen:
    return 0
  rows = np.stack([np.frombuffer(k, dtype="<f8") for k in seen])
  head = rows[:, :16]
  hits = 0
  for _, step in log:
    # v - step close to some seen g: compare on the first 16 weights, then confirm on all
    diff = np.abs((head[:, None, :] - step[:16]) - head[None, :, :]).sum(axis=2)
    np.fill_diagonal(diff, np.inf)
    i, j = np.unravel_index(np.argmin(diff), diff.shape)
    hits += bool(np.allclose(rows[i] - rows[j], step, rtol=0, atol=1e-9))
  return hits


def run(quota, honest, honest_rate, victim_updates, victim_period):
  extra = ["--draw-quota", str(quota), "--submit-quota", str(quota)] if quota else []
  cluster = common.start_cluster("memory", 1, 387, num_tokens=honest + 2, extra_args=extra,
                                 prefix="track")
  try:
    async def main():
      ctx = cluster.client_context()
      port = cluster.ports[0]
      b = common.noise_scale(cluster.spec)
      duration = victim_updates * victim_period + 2.0
      stop_at = time.perf_counter() + duration
      log, seen, counts = [], {}, {"draws": 0, "refused": 0}
      tasks = [_honest(common.Conn(port, cluster.tokens[i], ctx), np.random.default_rng(i), b,
                       stop_at, 1.0 / honest_rate) for i in range(honest)]
      tasks.append(_victim(common.Conn(port, cluster.tokens[honest], ctx),
                           np.random.default_rng(99), b, victim_updates, victim_period, log))
      tasks.append(_attacker(common.Conn(port, cluster.tokens[honest + 1], ctx), stop_at, seen,
                             counts))
      await asyncio.gather(*tasks)
      return log, seen, counts, duration

    log, seen, counts, duration = asyncio.run(main())
  finally:
    cluster.stop()
  hits = _identified(log, seen)
  return dict(draw_quota_per_s=quota, honest_clients=honest,
              honest_updates_per_s=honest * honest_rate, victim_updates=len(log),
              attacker_draws=counts["draws"], attacker_refused_429=counts["refused"],
              attacker_draws_per_s=round(counts["draws"] / duration, 1),
              pre_images_identified=hits,
              fraction=round(hits / max(len(log), 1), 3))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quota", type=float, default=2.0, help="draws (and submits) /s per token")
  ap.add_argument("--no-quota", action="store_true", help="also run without quotas")
  ap.add_argument("--honest", type=int, default=50)
  ap.add_argument("--honest-rate", type=float, default=2.0, help="updates/s per honest client")
  ap.add_argument("--victim-updates", type=int, default=40)
  ap.add_argument("--victim-period", type=float, default=0.5)
  args = ap.parse_args(argv)
  for quota in ([args.quota] + ([None] if args.no_quota else [])):
    print(json.dumps(run(quota, args.honest, args.honest_rate, args.victim_updates,
                         args.victim_period)), flush=True)


if __name__ == "__main__":
  main()
