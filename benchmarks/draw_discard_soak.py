"""Soak test: two TLS+token servers on one persistent Redis, a Redis restart halfway.

Runs paced clients (--rate updates/s in all) against two `tf-dpiter-ddml serve`
processes sharing a redis-server with AOF (appendfsync always) for --duration seconds.
Halfway, redis-server is stopped (SIGTERM) and restarted on the same port and directory
after --outage seconds. Clients retry after 503/connection errors (Retry-After, bounded).
At the end every acknowledged update's sequence number must be in the store: the seq
numbers the servers returned are unique and the store's seq and accepted counter equal
their count plus the updates whose answer was lost in the outage (reported).

  python benchmarks/draw_discard_soak.py --duration 600 --rate 200
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import ssl
import tempfile
import time
import urllib.request

import numpy as np

import draw_discard_common as common


async def _client(conn, rng, b, stop_at, period, stats):
  next_t = time.perf_counter()
  while time.perf_counter() < stop_at:
    next_t += period
    try:
      st, w, ticket, hdrs = await common.draw(conn)
      if st == 200:
        body, headers, _ = common.submit_args(w, ticket, rng, b)
        st, data, hdrs = await conn.request("POST", "/v1/submit", body, headers)
        if st == 200:
          stats["seqs"].append(json.loads(data)["seq"])
          stats["last_ok"] = time.perf_counter()
    except ConnectionError:
      st = "conn"
    if st != 200:
      stats["errors"][str(st)] += 1
      stats["first_error"] = stats["first_error"] or time.perf_counter()
      await asyncio.sleep(min(float(hdrs.get("retry-after", 1)) if st != "conn" else 0.2, 1.0))
    await asyncio.sleep(max(0.0, next_t - time.perf_counter()))


async def _restart_redis(state, delay, outage, redis_dir, port):
  await asyncio.sleep(delay)
  state["proc"].terminate()
  state["proc"].wait(30)
  state["stopped_at"] = time.perf_counter()
  await asyncio.sleep(outage)
  state["proc"], _ = common.start_redis(redis_dir, port, persistent=True)
  state["restarted_at"] = time.perf_counter()


def _metrics(cluster, port):
  ctx = ssl.create_default_context(cafile=cluster.cert)
  req = urllib.request.Request(f"https://127.0.0.1:{port}/v1/metrics",
                               headers={"Authorization": f"Bearer {cluster.tokens[0]}"})
  with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
    return json.loads(r.read())


def run(duration, rate, clients, outage, num_weights):
  """Runs the soak; returns a summary dict."""
  redis_dir = tempfile.mkdtemp(prefix="ddml_soak_redis_")
  proc, port = common.start_redis(redis_dir, persistent=True)
  state = {"proc": proc}
  cluster = common.start_cluster(f"redis://127.0.0.1:{port}/0", 2, num_weights,
                                 num_tokens=clients, prefix="soak")
  stats = {"seqs": [], "errors": collections.Counter(), "first_error": None, "last_ok": None}
  try:
    async def main():
      ctx = cluster.client_context()
      conns = [common.Conn(cluster.ports[i % 2], cluster.tokens[i], ctx) for i in range(clients)]
      b = common.noise_scale(cluster.spec)
      t0 = time.perf_counter()
      stop_at = t0 + duration
      tasks = [_client(c, np.random.default_rng(i), b, stop_at, clients / rate, stats)
               for i, c in enumerate(conns)]
      await asyncio.gather(_restart_redis(state, duration / 2, outage, redis_dir, port), *tasks)
      for c in conns:
        c.close()
      return t0

    t0 = asyncio.run(main())
    m = [_metrics(cluster, p) for p in cluster.ports]
    alive = [p.poll() is None for p in cluster.procs]
  finally:
    cluster.stop()
    state["proc"].terminate()
    state["proc"].wait(30)
    shutil.rmtree(redis_dir, ignore_errors=True)
  seqs = stats["seqs"]
  return dict(duration_s=duration, target_rate=rate, clients=clients, outage_s=outage,
              num_weights=num_weights, acknowledged=len(seqs), unique_seqs=len(set(seqs)),
              store_seq=m[0]["seq"], store_accepted=m[0]["accepted"],
              servers_agree=m[0]["seq"] == m[1]["seq"], servers_alive=alive,
              stored_but_unacknowledged=m[0]["seq"] - len(set(seqs)),
              lost=len(set(seqs) - set(range(1, m[0]["seq"] + 1))),
              errors=dict(stats["errors"]),
              redis_down_at_s=round(state["stopped_at"] - t0, 1),
              redis_up_at_s=round(state["restarted_at"] - t0, 1),
              achieved_rate=round(len(seqs) / duration, 1))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--duration", type=float, default=600.0)
  ap.add_argument("--rate", type=float, default=200.0, help="target updates/s, all clients")
  ap.add_argument("--clients", type=int, default=16)
  ap.add_argument("--outage", type=float, default=3.0, help="seconds Redis stays down")
  ap.add_argument("--weights", type=int, default=387)
  args = ap.parse_args(argv)
  out = run(args.duration, args.rate, args.clients, args.outage, args.weights)
  print(json.dumps(out))
  ok = out["lost"] == 0 and out["unique_seqs"] == out["acknowledged"] and all(out["servers_alive"])
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
