"""Fixtures for the Draw and Discard tests: an in-process service, TLS certificates and a
real redis-server."""

import asyncio
import datetime
import http.client
import importlib.util
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from tf_dpiter.draw_discard import client


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def honest(spec, weights, rng):
  """Algorithm 1 on 8 random records: what an honest client returns for `weights`."""
  x = {"x": rng.random((8, spec.num_weights - 1))}
  return client.spec_update(spec, weights, x, rng.integers(0, 2, 8), rng=rng)


def http_request(port, method, path, body=None, headers=None):
  """(status, headers, body) of one request to 127.0.0.1:port on a new connection."""
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
  try:
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    return r.status, r.headers, r.read()
  finally:
    conn.close()


def connect_from(port, src="127.0.0.1"):
  """A socket connected to 127.0.0.1:port from loopback address `src` (5 s timeout)."""
  s = socket.socket()
  s.bind((src, 0))
  s.settimeout(5)
  s.connect(("127.0.0.1", port))
  return s


def http_status(port, token=None, path="/v1/spec", src="127.0.0.1"):
  """The status of one GET to 127.0.0.1:port from address `src`, with a bearer token."""
  s = connect_from(port, src)
  head = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
  head += f"Authorization: Bearer {token}\r\n" if token else ""
  s.sendall((head + "\r\n").encode())
  data = s.recv(65536)
  s.close()
  return int(data.split(b" ", 2)[1])


def serve_process(spec_path, tokens_path, port):
  """`tf-dpiter-ddml serve` with a token file as a child process (for signal tests)."""
  return subprocess.Popen([sys.executable, "-m", "tf_dpiter.draw_discard.cli", "serve",
                           "--model", str(spec_path), "--tokens", str(tokens_path), "--port",
                           str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))


def wait_serving(port, token, timeout_s=60.0):
  """Waits until a GET with `token` answers 200 (or the time is up)."""
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    try:
      if http_status(port, token) == 200:
        return
    except OSError:
      time.sleep(0.1)


class ThreadedService:
  """Runs a DDMLService through http_server.serve on its own event loop in a daemon thread."""

  def __init__(self, svc, ssl_context=None, limits=None):
    self.svc = svc
    self.loop = asyncio.new_event_loop()
    self._ready = threading.Event()
    self._error = None
    self.scheme = "https" if ssl_context else "http"
    self.thread = threading.Thread(target=self._run, args=(ssl_context, limits), daemon=True)
    self.thread.start()
    if not self._ready.wait(30):
      raise RuntimeError("service did not start")
    if self._error is not None:
      raise self._error

  def _run(self, ssl_context, limits):
    from tf_dpiter.draw_discard import http_server
    asyncio.set_event_loop(self.loop)
    try:
      self.running = self.loop.run_until_complete(
          http_server.serve(self.svc, "127.0.0.1", 0, ssl_context, limits))
    except (OSError, RuntimeError, ValueError) as e:  # re-raised in the test thread by __init__
      self._error = e
      self._ready.set()
      return
    self.port = self.running.port
    self._ready.set()
    self.loop.run_forever()

  @property
  def url(self):
    return f"{self.scheme}://127.0.0.1:{self.port}"

  def call(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

  def stop(self):
    self.call(self.running.stop())
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join(10)


@pytest.fixture
def start_service():
  started = []

  def _start(svc, ssl_context=None, limits=None):
    s = ThreadedService(svc, ssl_context, limits)
    started.append(s)
    return s

  yield _start
  for s in started:
    s.stop()


def _self_signed_cryptography(cert_path, key_path):
  from cryptography import x509
  from cryptography.hazmat.primitives import hashes, serialization
  from cryptography.hazmat.primitives.asymmetric import ec
  from cryptography.x509.oid import NameOID
  key = ec.generate_private_key(ec.SECP256R1())
  name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
  now = datetime.datetime.now(datetime.timezone.utc)
  cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
          .public_key(key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.SubjectAlternativeName(
              [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
              critical=False)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(key, hashes.SHA256()))
  key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
  cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _self_signed_openssl(cert_path, key_path):
  subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                  "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                  "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                  "-keyout", str(key_path), "-out", str(cert_path)],
                 check=True, capture_output=True)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
  """(cert.pem, key.pem) of a self-signed certificate for 127.0.0.1, made at test time."""
  d = tmp_path_factory.mktemp("tls")
  cert, key = d / "cert.pem", d / "key.pem"
  if importlib.util.find_spec("cryptography") is not None:
    _self_signed_cryptography(cert, key)
  elif shutil.which("openssl") is not None:
    _self_signed_openssl(cert, key)
  else:
    pytest.skip("neither the cryptography package nor the openssl command is available")
  return str(cert), str(key)


def start_redis(port, data_dir, persistent=False):
  """A redis-server on 127.0.0.1:port (AOF with fsync always when persistent)."""
  exe = shutil.which("redis-server")
  args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir), "--save", ""]
  args += ["--appendonly", "yes", "--appendfsync", "always"] if persistent else ["--appendonly", "no"]
  proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 20
  while time.time() < deadline:
    try:
      with socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return proc
    except OSError:
      time.sleep(0.05)
  proc.kill()
  raise RuntimeError("redis-server did not start")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
  if shutil.which("redis-server") is None:
    pytest.skip("redis-server binary not found (apt-get install -y redis-server; CI installs it)")
  port = free_port()
  proc = start_redis(port, tmp_path_factory.mktemp("redis"))
  yield f"redis://127.0.0.1:{port}/0"
  proc.terminate()
  proc.wait(10)


@pytest.fixture
def own_redis(tmp_path):
  """A private redis-server for this test: (url, process); the test may stop it."""
  if shutil.which("redis-server") is None:
    pytest.skip("redis-server binary not found (apt-get install -y redis-server; CI installs it)")
  port = free_port()
  proc = start_redis(port, tmp_path)
  yield f"redis://127.0.0.1:{port}/0", proc
  if proc.poll() is None:
    proc.terminate()
    proc.wait(10)
