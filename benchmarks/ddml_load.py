"""Load test of the Draw and Discard HTTP service (tf-dpiter-ddml serve) on loopback.

Starts one server process (memory or Redis store; a private redis-server in a temp dir
unless --redis-url is given) and one load-generator process with --clients concurrent
clients on keep-alive connections. One update = GET /v1/draw then POST /v1/submit with
the drawn instance: raw float64 bodies by default, --encoding b64 for JSON + base64. The
clients echo the instance (no Algorithm 1 compute), so the figure is the server's
capacity. Reports updates/s, p50/p99 latency of one update (draw + submit), and the
server's CPU time per update (contention-independent) per (model size, store).

  nice python benchmarks/ddml_load.py --weights 387 50000 --stores memory redis --duration 10

The paper's production peak was 200 updates/s (Section I); models of 387 weights (phishing,
Section VI-A) and 50,000 weights (ranking, Section VI-B).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


async def _http(reader, writer, method: str, path: str, body: bytes = b"",
                content_type: str = "application/json", version: str = "1"):
  head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
          f"Content-Type: {content_type}\r\nX-DDML-Version: {version}\r\n\r\n").encode()
  writer.write(head + body)
  status_line = await reader.readline()
  length = 0
  while True:
    line = await reader.readline()
    if line in (b"\r\n", b""):
      break
    if line[:15].lower() == b"content-length:":
      length = int(line[15:])
  data = await reader.readexactly(length)
  return int(status_line.split()[1]), data


async def _worker(port: int, stop_at: float, lat: list, errors: list, encoding: str = "raw",
                  version: str = "1"):
  reader, writer = await asyncio.open_connection("127.0.0.1", port)
  try:
    while time.perf_counter() < stop_at:
      t0 = time.perf_counter()
      if encoding == "raw":
        st, data = await _http(reader, writer, "GET", "/v1/draw?encoding=raw")
        st2, _ = await _http(reader, writer, "POST", "/v1/submit", data,
                             "application/octet-stream", version)
      else:
        st, data = await _http(reader, writer, "GET", "/v1/draw?encoding=b64")
        d = json.loads(data)
        body = ('{"version":' + json.dumps(d["version"]) + ',"weights_b64":"' + d["weights_b64"]
                + '"}').encode()
        st2, _ = await _http(reader, writer, "POST", "/v1/submit", body)
      if st != 200 or st2 != 200:
        errors.append((st, st2))
      lat.append(time.perf_counter() - t0)
  finally:
    writer.close()


def _load_proc(port: int, clients: int, duration: float, warmup: float, q, encoding: str = "raw"):
  async def main():
    lat, errors, warm = [], [], []
    # warm-up (not measured)
    await asyncio.gather(*[_worker(port, time.perf_counter() + warmup, warm, [], encoding)
                           for _ in range(clients)])
    t0 = time.perf_counter()
    await asyncio.gather(*[_worker(port, t0 + duration, lat, errors, encoding)
                           for _ in range(clients)])
    return lat, errors, time.perf_counter() - t0, len(warm)
  try:
    import uvloop  # pylint: disable=g-import-not-at-top
    lat, errors, wall, n_warm = uvloop.run(main())
  except ImportError:
    lat, errors, wall, n_warm = asyncio.run(main())
  q.put((lat, len(errors), wall, n_warm))


def _cpu_seconds(pid: int) -> float:
  """utime + stime of a process (Linux /proc), in seconds."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_redis():
  exe = shutil.which("redis-server")
  if exe is None:
    raise SystemExit("redis-server not found: apt-get install -y redis-server")
  port = free_port()
  d = tempfile.mkdtemp(prefix="ddml_redis_")
  proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", d,
                           "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
  for _ in range(200):
    try:
      socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
      break
    except OSError:
      time.sleep(0.05)
  return proc, f"redis://127.0.0.1:{port}/0"


def _wait(port, proc, timeout=180):
  import http.client  # pylint: disable=g-import-not-at-top
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise RuntimeError("server exited")
    try:
      c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
      c.request("GET", "/healthz")
      if c.getresponse().status == 200:
        return
    except OSError:
      time.sleep(0.3)
  raise RuntimeError("server not healthy")


def run_one(num_weights: int, store: str, k: int, clients: int, duration: float, warmup: float,
            spam_t: float | None, encoding: str = "raw") -> dict:
  sys.path.insert(0, REPO)
  from tf_dpiter.draw_discard.cli import dense_spec  # pylint: disable=g-import-not-at-top
  tmp = tempfile.mkdtemp(prefix="ddml_load_")
  spec_path = os.path.join(tmp, "spec.json")
  with open(spec_path, "w") as f:
    f.write(dense_spec(num_weights).to_json())
  port = free_port()
  cmd = [sys.executable, "-m", "tf_dpiter.draw_discard.cli", "serve", "--k", str(k),
         "--model", spec_path, "--store", store, "--port", str(port), "--reset",
         "--prefix", f"load{num_weights}"]
  if spam_t is not None:
    cmd += ["--spam-t", str(spam_t)]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
  srv = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    _wait(port, srv)
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_load_proc, args=(port, clients, duration, warmup, q, encoding))
    cpu0 = _cpu_seconds(srv.pid)
    p.start()
    lat, n_err, wall, n_warm = q.get()
    p.join()
    cpu = _cpu_seconds(srv.pid) - cpu0
  finally:
    srv.terminate()
    srv.wait(20)
  lat = np.asarray(lat)
  return dict(num_weights=num_weights, store=store.split(":")[0], k=k, clients=clients,
              encoding=encoding,
              updates=len(lat), errors=n_err, seconds=round(wall, 2),
              updates_per_s=round(len(lat) / wall, 1),
              p50_ms=round(float(np.percentile(lat, 50)) * 1e3, 2),
              p99_ms=round(float(np.percentile(lat, 99)) * 1e3, 2),
              # server CPU per update (warm-up included in both counts): contention-independent;
              # 1e6 / it is the rate one dedicated core would sustain for the server process
              server_cpu_us_per_update=round(cpu / (len(lat) + n_warm) * 1e6, 1),
              one_core_capacity_per_s=round((len(lat) + n_warm) / max(cpu, 1e-9), 1))


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--weights", type=int, nargs="+", default=[387, 50000])
  ap.add_argument("--stores", nargs="+", default=["memory", "redis"])
  ap.add_argument("--redis-url", default=None, help="use this Redis instead of a private one")
  ap.add_argument("--k", type=int, default=20)
  ap.add_argument("--clients", type=int, default=32, help="concurrent clients (bounded)")
  ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
  ap.add_argument("--warmup", type=float, default=1.0)
  ap.add_argument("--spam-t", type=float, default=None)
  ap.add_argument("--encoding", choices=("raw", "b64"), default="raw",
                  help="raw float64 bodies (octet-stream) or JSON with base64 weights")
  ap.add_argument("--json", default=None, help="write the results here")
  args = ap.parse_args()
  redis_proc = None
  results = []
  try:
    for store in args.stores:
      url = store
      if store == "redis":
        if args.redis_url:
          url = args.redis_url
        else:
          redis_proc, url = _start_redis()
      for n in args.weights:
        r = run_one(n, url, args.k, args.clients, args.duration, args.warmup, args.spam_t,
                    args.encoding)
        results.append(r)
        print(json.dumps(r), flush=True)
  finally:
    if redis_proc is not None:
      redis_proc.terminate()
  print("\n| weights | store | encoding | k | clients | updates/s | p50 ms | p99 ms | errors "
        "| server CPU us/update | 1-core capacity/s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for r in results:
    print(f"| {r['num_weights']} | {r['store']} | {r['encoding']} | {r['k']} | {r['clients']} | {r['updates_per_s']} "
          f"| {r['p50_ms']} | {r['p99_ms']} | {r['errors']} | {r['server_cpu_us_per_update']} "
          f"| {r['one_core_capacity_per_s']} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
