"""Load test of the hardened Draw-and-Discard service: TLS + bearer tokens + quotas on.

One or two `tf-dpiter-ddml serve` processes (memory store: one; Redis: --servers, default
two, sharing one private redis-server) and one load-generator process with --clients
concurrent clients (one token each, keep-alive TLS connections, client i on server
i mod servers). One update = GET /v1/draw (raw) + POST /v1/submit of the drawn instance
plus Laplace noise, which the acceptance rule admits. Reports updates/s, p50/p99 latency
of one update and the servers' (and the load generator's) CPU time per update, with the
1-minute load average (os.getloadavg) before and after each run.

  python benchmarks/draw_discard_load.py --stores memory redis --clients 16 64 --duration 10
  python benchmarks/draw_discard_load.py --stores memory redis --servers 1 2 --clients 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time

import numpy as np

import draw_discard_common as common


async def _worker(conn, stop_at, lat, errors, b, seed, piggyback=False, tokens=()):
  rng = np.random.default_rng(seed)
  w = None
  turn = 0
  while time.perf_counter() < stop_at:
    if tokens and w is None:  # --serve-defaults: the next of this client's tokens
      conn.token, turn = tokens[turn % len(tokens)], turn + 1
    t0 = time.perf_counter()
    try:
      if piggyback:
        st, w = await common.piggyback_update(conn, rng, b, w)
        st2 = st
      else:
        st, st2 = await common.one_update(conn, rng, b)
    except ConnectionError:
      st, st2, w = -1, -1, None
    if st != 200 or st2 != 200:
      errors.append((st, st2))
    else:
      lat.append(time.perf_counter() - t0)


def _load_proc(ports, tokens, cert, clients, duration, warmup, b, q, piggyback=False):
  import ssl  # pylint: disable=g-import-not-at-top

  async def main():
    ctx = ssl.create_default_context(cafile=cert) if cert else None
    conns = [common.Conn(ports[i % len(ports)], tokens[i % len(tokens)], ctx)
             for i in range(clients)]
    # with more tokens than clients, client i rotates through tokens i, i + clients, ...
    mine = [tokens[i::clients] if len(tokens) > clients else () for i in range(clients)]
    warm = []
    await asyncio.gather(*[_worker(c, time.perf_counter() + warmup, warm, [], b, i, piggyback,
                                   mine[i]) for i, c in enumerate(conns)])
    lat, errors = [], []
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*[_worker(c, t0 + duration, lat, errors, b, 1000 + i, piggyback,
                                   mine[i]) for i, c in enumerate(conns)])
    wall, client_cpu = time.perf_counter() - t0, time.process_time() - c0
    for c in conns:
      c.close()
    return lat, errors, wall, len(warm), client_cpu

  try:
    import uvloop  # pylint: disable=g-import-not-at-top
    out = uvloop.run(main())
  except ImportError:
    out = asyncio.run(main())
  q.put(out)


def run_one(store: str, servers: int, clients: int, duration: float, warmup: float,
            num_weights: int, quota: float, tls: bool = True, piggyback: bool = False,
            server_args=(), serve_defaults: int = 0) -> dict:
  """One measured configuration (servers are started and stopped here).

  serve_defaults > 0: `serve`'s own quota and influence defaults (draw quota 2/s per token,
  no submit quota, influence rate 8 per 300 s half-life) with that many tokens, which the
  clients rotate through (each token stays inside the defaults during the run).
  """
  if serve_defaults:
    extra = ["--draw-quota", "2", "--influence-steps", "8", *server_args]
  else:
    extra = ["--draw-quota", str(quota), "--submit-quota", str(quota), *server_args]
  load_before = os.getloadavg()[0]
  cluster = common.start_cluster(store, servers, num_weights,
                                 num_tokens=serve_defaults or clients, extra_args=extra,
                                 prefix=f"load{num_weights}", tls=tls)
  try:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_load_proc, args=(cluster.ports, cluster.tokens, cluster.cert,
                                                clients, duration, warmup,
                                                common.noise_scale(cluster.spec), q,
                                                piggyback))
    cpu0 = sum(common.cpu_seconds(p.pid) for p in cluster.procs)
    proc.start()
    lat, errors, wall, n_warm, client_cpu = q.get()
    proc.join()
    cpu = sum(common.cpu_seconds(p.pid) for p in cluster.procs) - cpu0
  finally:
    cluster.stop()
  load_after = os.getloadavg()[0]
  lat = np.asarray(lat)
  statuses = sorted({str(e) for e in errors})[:5]
  return dict(num_weights=num_weights, store=store.split(":")[0], servers=servers,
              server_args=" ".join(server_args),
              clients=clients, tls=tls, tokens=serve_defaults or clients, piggyback=piggyback,
              quota_per_token_per_s=None if serve_defaults else quota,
              updates=len(lat), errors=len(errors), error_statuses=statuses,
              seconds=round(wall, 2), updates_per_s=round(len(lat) / wall, 1),
              p50_ms=round(float(np.percentile(lat, 50)) * 1e3, 2) if len(lat) else None,
              p99_ms=round(float(np.percentile(lat, 99)) * 1e3, 2) if len(lat) else None,
              server_cpu_us_per_update=round(cpu / max(len(lat) + n_warm, 1) * 1e6, 1),
              client_cpu_us_per_update=round(client_cpu / max(len(lat), 1) * 1e6, 1),
              load_before=round(load_before, 2), load_after=round(load_after, 2))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--stores", nargs="+", default=["memory", "redis"])
  ap.add_argument("--clients", type=int, nargs="+", default=[16, 64])
  ap.add_argument("--servers", type=int, nargs="+", default=[2],
                  help="server processes on the Redis store (the memory store has one)")
  ap.add_argument("--duration", type=float, default=10.0)
  ap.add_argument("--warmup", type=float, default=1.0)
  ap.add_argument("--weights", type=int, default=387)
  ap.add_argument("--quota", type=float, default=1000.0, help="draws and submits/s per token")
  ap.add_argument("--no-tls", action="store_true", help="plain HTTP (tokens stay on)")
  ap.add_argument("--piggyback", action="store_true",
                  help="one request per update: POST /v1/submit?draw=raw returns the next draw")
  ap.add_argument("--server-args", default="",
                  help="extra `tf-dpiter-ddml serve` arguments, e.g. '--no-group-commit'")
  ap.add_argument("--serve-defaults", type=int, default=0, metavar="TOKENS",
                  help="serve's quota and influence defaults instead of --quota and no "
                       "influence rate, with this many tokens rotated by the clients")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  results, redis_proc, redis_dir = [], None, None
  try:
    for store in args.stores:
      url = "memory"
      if store == "redis":
        redis_dir = tempfile.mkdtemp(prefix="ddml_redis_")
        redis_proc, port = common.start_redis(redis_dir, persistent=False)
        url = f"redis://127.0.0.1:{port}/0"
      for servers in ([1] if store == "memory" else args.servers):
        for clients in args.clients:
          r = run_one(url, servers, clients, args.duration, args.warmup, args.weights,
                      args.quota, tls=not args.no_tls, piggyback=args.piggyback,
                      server_args=args.server_args.split(),
                      serve_defaults=args.serve_defaults)
          results.append(r)
          print(json.dumps(r), flush=True)
  finally:
    if redis_proc is not None:
      redis_proc.terminate()
      redis_proc.wait(10)
      shutil.rmtree(redis_dir, ignore_errors=True)
  print("\n| store | servers | TLS | piggyback | clients | updates/s | p50 ms | p99 ms | errors "
        "| server CPU us/update | load before, after |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for r in results:
    print(f"| {r['store']} | {r['servers']} | {r['tls']} | {r['piggyback']} | {r['clients']} "
          f"| {r['updates_per_s']} "
          f"| {r['p50_ms']} "
          f"| {r['p99_ms']} | {r['errors']} | {r['server_cpu_us_per_update']} "
          f"| {r['load_before']}, {r['load_after']} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
