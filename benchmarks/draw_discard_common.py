"""Shared helpers of the Draw-and-Discard service benchmarks (load, soak, draw tracking).

Starts redis-server and `tf-dpiter-ddml serve` processes on 127.0.0.1 with TLS (a
self-signed certificate made by the openssl command) and bearer tokens, and runs
bounded asyncio HTTP/1.1 clients that draw an instance and submit an update that the
acceptance rule admits (the drawn instance plus Algorithm 1's Laplace noise, no gradient),
with the draw ticket: the raw body is the drawn instance then the update.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time

import numpy as np

from tf_dpiter.draw_discard import privacy
from tf_dpiter.draw_discard.cli import dense_spec


def free_port() -> int:
  """A free TCP port on 127.0.0.1."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def make_cert(directory: str) -> tuple[str, str]:
  """Self-signed certificate for 127.0.0.1 (openssl command): (cert.pem, key.pem)."""
  cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
  subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                  "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                  "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                 check=True, capture_output=True)
  return cert, key


def start_redis(directory: str, port: int | None = None, persistent: bool = True):
  """redis-server on 127.0.0.1 (AOF, fsync always when persistent): (process, port)."""
  exe = shutil.which("redis-server")
  if exe is None:
    raise SystemExit("redis-server not found: apt-get install -y redis-server")
  port = port or free_port()
  args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory, "--save", ""]
  args += (["--appendonly", "yes", "--appendfsync", "always"] if persistent
           else ["--appendonly", "no"])
  proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 20
  while time.time() < deadline:
    try:
      socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
      return proc, port
    except OSError:
      time.sleep(0.05)
  proc.kill()
  raise RuntimeError("redis-server did not start")


@dataclasses.dataclass
class Cluster:
  """Server processes sharing one store, with their TLS and token files."""
  procs: list
  ports: list
  cert: str
  tokens: list
  spec: object
  tmp: str

  def client_context(self) -> ssl.SSLContext | None:
    return ssl.create_default_context(cafile=self.cert) if self.cert else None

  def stop(self, keep_files: bool = False) -> None:
    for p in self.procs:
      p.terminate()
    for p in self.procs:
      p.wait(20)
    if not keep_files:
      shutil.rmtree(self.tmp, ignore_errors=True)


def start_cluster(store: str, servers: int, num_weights: int = 387, k: int = 20,
                  num_tokens: int = 64, extra_args=(), prefix: str = "bench",
                  tls: bool = True) -> Cluster:
  """`servers` processes of `tf-dpiter-ddml serve` with tokens (and TLS) on one store."""
  tmp = tempfile.mkdtemp(prefix="ddml_bench_")
  spec = dense_spec(num_weights)
  spec_path = os.path.join(tmp, "spec.json")
  with open(spec_path, "w") as f:
    f.write(spec.to_json())
  tokens = [f"bench-token-{i:04d}-{os.urandom(8).hex()}" for i in range(num_tokens)]
  with open(os.path.join(tmp, "tokens.txt"), "w") as f:
    f.write("\n".join(tokens) + "\n")
  cert, key = make_cert(tmp)
  # The servers' shared secret (keys.py; required with Redis). Load clients reuse a few
  # tokens at high rates: the per-token influence rate cap and the default draw quota
  # would refuse them, so the benchmarks turn both off unless asked (dd_poisoning.py
  # measures the cap); /v1/model is not used here.
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env.setdefault("DDML_SECRET", os.urandom(32).hex())
  defaults = [] if "--influence-steps" in extra_args else ["--influence-steps", "none"]
  defaults += [] if "--draw-quota" in extra_args else ["--draw-quota", "none"]
  procs, ports = [], []
  for i in range(servers):
    port = free_port()
    cmd = [sys.executable, "-m", "tf_dpiter.draw_discard.cli", "serve", "--k", str(k),
           "--model", spec_path, "--store", store, "--port", str(port), "--prefix", prefix,
           "--tokens", os.path.join(tmp, "tokens.txt"), *defaults, *extra_args]
    if tls:
      cmd += ["--tls-cert", cert, "--tls-key", key]
    if i == 0:
      cmd.append("--reset")
    log = open(os.path.join(tmp, f"server{i}.log"), "w")
    procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    ports.append(port)
    wait_healthy(port, procs[-1], cert if tls else None)
  return Cluster(procs, ports, cert if tls else None, tokens, spec, tmp)


def wait_healthy(port: int, proc, cert: str | None, timeout: float = 120.0) -> None:
  """Waits for /healthz 200 (over TLS when cert is given)."""
  ctx = ssl.create_default_context(cafile=cert) if cert else None
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"server exited with {proc.returncode}")
    try:
      c = (http.client.HTTPSConnection("127.0.0.1", port, timeout=2, context=ctx) if ctx
           else http.client.HTTPConnection("127.0.0.1", port, timeout=2))
      c.request("GET", "/healthz")
      if c.getresponse().status == 200:
        return
    except OSError:
      time.sleep(0.2)
  raise RuntimeError("server not healthy")


class Conn:
  """One keep-alive HTTP/1.1 connection (asyncio streams, optional TLS)."""

  def __init__(self, port: int, token: str, ctx: ssl.SSLContext | None):
    self.port, self.token, self.ctx = port, token, ctx
    self.reader = self.writer = None

  async def request(self, method: str, path: str, body: bytes = b"",
                    headers: str = "") -> tuple[int, bytes, dict]:
    if self.writer is None:
      self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port,
                                                               ssl=self.ctx)
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {self.token}"
            f"\r\nContent-Length: {len(body)}\r\n{headers}\r\n").encode()
    try:
      self.writer.write(head + body)
      status_line = await self.reader.readline()
      hdrs = {}
      while True:
        line = await self.reader.readline()
        if line in (b"\r\n", b""):
          break
        name, _, value = line.decode("latin-1").partition(":")
        hdrs[name.strip().lower()] = value.strip()
      data = await self.reader.readexactly(int(hdrs.get("content-length", 0)))
    except (OSError, asyncio.IncompleteReadError, ValueError):
      self.close()
      raise ConnectionError("connection lost")
    if not status_line or hdrs.get("connection", "").lower() == "close":
      self.close()
    return (int(status_line.split()[1]) if status_line else 0), data, hdrs

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()
    self.reader = self.writer = None


def noise_scale(spec) -> float:
  """Laplace scale b of the spec's client noise."""
  return privacy.laplace_scale(spec.gamma, spec.epsilon, spec.clip)


def submit_args(w: np.ndarray, ticket: str, rng: np.random.Generator, b: float):
  """(body, headers, step) of a ticketed raw submit of w plus Laplace(b) noise."""
  step = b * (rng.standard_exponential(w.size) - rng.standard_exponential(w.size))
  body = np.ascontiguousarray(w, dtype="<f8").tobytes() + (w + step).astype("<f8").tobytes()
  headers = ("Content-Type: application/octet-stream\r\nX-DDML-Version: 1\r\n"
             f"X-DDML-Ticket: {ticket}\r\n")
  return body, headers, step


async def draw(conn: Conn) -> tuple[int, np.ndarray | None, str | None, dict]:
  """GET /v1/draw?encoding=raw: (status, instance, ticket, headers)."""
  st, data, hdrs = await conn.request("GET", "/v1/draw?encoding=raw")
  if st != 200:
    return st, None, None, hdrs
  return st, np.frombuffer(data, dtype="<f8"), hdrs.get("x-ddml-ticket"), hdrs


async def one_update(conn: Conn, rng: np.random.Generator, b: float) -> tuple[int, int]:
  """Draw (raw) then submit the drawn instance plus Laplace(b) noise: (draw, submit) status."""
  st, w, ticket, _ = await draw(conn)
  if st != 200:
    return st, 0
  body, headers, _ = submit_args(w, ticket, rng, b)
  st2, _, _ = await conn.request("POST", "/v1/submit", body, headers)
  return st, st2


def cpu_seconds(pid: int) -> float:
  """utime + stime of a process (Linux /proc), in seconds."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def piggyback_update(conn: Conn, rng: np.random.Generator, b: float,
                           drawn: tuple | None) -> tuple[int, tuple | None]:
  """One update with the next draw in the submit's answer (POST /v1/submit?draw=raw).

  `drawn` is (instance, ticket) or None (then draws with GET first). Returns (status, the
  next (instance, ticket) or None).
  """
  if drawn is None:
    st, w, ticket, _ = await draw(conn)
    if st != 200:
      return st, None
    drawn = (w, ticket)
  body, headers, _ = submit_args(drawn[0], drawn[1], rng, b)
  st, data, hdrs = await conn.request("POST", "/v1/submit?draw=raw", body, headers)
  nxt = ((np.frombuffer(data, dtype="<f8"), hdrs.get("x-ddml-ticket"))
         if st == 200 and hdrs.get("content-type", "").startswith("application/octet") else None)
  return st, nxt
