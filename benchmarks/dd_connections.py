"""Connection accounting under attack (loopback, TLS + tokens): issue 29 findings 1 and 2.

One in-process server (TLS, tokens, default limits: 1024 connections, 256 per address,
15 s idle timeout) and, one scenario at a time:

  tls_hold     one address opens --hold TCP connections to the TLS port and never starts
               the handshake; reports how many the server keeps counted/open.
  five_hold    five addresses (127.0.0.2-6) open --hold / 5 such connections each; then
               an honest client (127.0.0.1, its own TLS connection) makes --updates updates.
  churn        one address (127.0.0.3) connects and closes as fast as it can (a thread)
               while the honest client makes --updates updates (a new connection each).
  nat_churn    one address makes --nat-rate sequential TLS connections per second, one
               request each, for --nat-seconds seconds.

Reports the honest updates that succeeded. Client addresses are 127.0.0.x (Linux routes
all of 127/8 to the loopback interface).

  python -m benchmarks.dd_connections --hold 1800 --updates 125   # from the repository root
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import subprocess
import tempfile
import threading
import time

import numpy as np

from tests.draw_discard.conftest import ThreadedService

from tf_dpiter.draw_discard import auth, client, client_lib, http_server, service  # noqa: E402
from tf_dpiter.draw_discard import store as store_lib  # noqa: E402
from tf_dpiter.draw_discard.cli import dense_spec  # noqa: E402

TOKEN = "honest-token-0123456789abcdef"


def _cert(d):
  cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
  subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                  "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                  "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                 check=True, capture_output=True)
  return cert, key


def _raw(port, src):
  s = socket.socket()
  s.bind((src, 0))
  s.settimeout(5)
  try:
    s.connect(("127.0.0.1", port))
  except OSError:
    s.close()
    return None
  return s


def _honest(srv, cert, n, fresh):
  spec, ok = srv.svc.spec, 0
  rng = np.random.default_rng(0)
  c = client_lib.DDMLClient(srv.url, token=TOKEN, cafile=cert)
  for _ in range(n):
    try:
      d = c.draw()
      u = client.spec_update(spec, d.weights, {"x": rng.random((8, spec.num_weights - 1))},
                             rng.integers(0, 2, 8), rng=rng)
      c.submit(d, u)
      ok += 1
    except (client_lib.DDMLError, OSError, ConnectionError, ssl.SSLError):
      pass
    if fresh:
      c.close()
      c = client_lib.DDMLClient(srv.url, token=TOKEN, cafile=cert)
  c.close()
  return ok


def _guard_count(srv):
  async def f():
    return srv.svc.connection_guard.count()
  return srv.call(f())


def run(scenario, args, cert, key):
  svc = service.DDMLService(dense_spec(33, epsilon=1.0, gamma=0.01), 20, store_lib.MemoryStore(),
                            tokens=auth.TokenSet([TOKEN]), seed=0, influence_steps=None)
  srv = ThreadedService(svc, http_server.tls_context(cert, key), http_server.Limits())
  # connection_guard.count() is read on the server's loop (srv.call)
  out = dict(scenario=scenario)
  held = []
  try:
    if scenario in ("tls_hold", "five_hold"):
      addrs = ["127.0.0.2"] if scenario == "tls_hold" else [f"127.0.0.{i}" for i in range(2, 7)]
      for i in range(args.hold):
        s = _raw(srv.port, addrs[i % len(addrs)])
        if s is not None:
          held.append(s)
      time.sleep(1.0)
      out.update(attempted=args.hold, server_counted=_guard_count(srv))
      if scenario == "five_hold":
        out.update(honest_ok=_honest(srv, cert, args.updates, fresh=False),
                   honest_total=args.updates)
    elif scenario == "churn":
      stop, churned = threading.Event(), [0]

      def churn():
        while not stop.is_set():
          s = _raw(srv.port, "127.0.0.3")
          if s is not None:
            s.close()
            churned[0] += 1
      t = threading.Thread(target=churn, daemon=True)
      t.start()
      t0 = time.time()
      ok = _honest(srv, cert, args.updates, fresh=True)
      stop.set()
      t.join(5)
      out.update(churn_per_s=round(churned[0] / (time.time() - t0)), honest_ok=ok,
                 honest_total=args.updates)
    else:
      ctx = ssl.create_default_context(cafile=cert)
      ok = total = 0
      t_end = time.time() + args.nat_seconds
      while time.time() < t_end:
        t = time.time()
        total += 1
        s = _raw(srv.port, "127.0.0.4")
        try:
          with ctx.wrap_socket(s, server_hostname="127.0.0.1") as t_s:
            t_s.sendall(f"GET /v1/spec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                        "Connection: close\r\n\r\n".encode())
            ok += t_s.recv(64).startswith(b"HTTP/1.1 200")
        except (OSError, ssl.SSLError, AttributeError):
          pass
        time.sleep(max(0.0, 1.0 / args.nat_rate - (time.time() - t)))
      out.update(connections=total, ok=ok, per_s=round(total / args.nat_seconds))
  finally:
    for s in held:
      s.close()
    srv.stop()
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("--hold", type=int, default=1800)
  ap.add_argument("--updates", type=int, default=125)
  ap.add_argument("--nat-rate", type=float, default=200.0)
  ap.add_argument("--nat-seconds", type=float, default=3.0)
  ap.add_argument("--scenarios", nargs="+", default=["tls_hold", "five_hold", "churn", "nat_churn"])
  args = ap.parse_args(argv)
  with tempfile.TemporaryDirectory() as d:
    cert, key = _cert(d)
    for sc in args.scenarios:
      print(json.dumps(run(sc, args, cert, key)), flush=True)


if __name__ == "__main__":
  main()
