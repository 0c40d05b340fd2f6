"""Fixtures for the Draw and Discard tests: an in-process service and a real redis-server."""

import asyncio
import shutil
import socket
import subprocess
import threading
import time

import pytest


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ThreadedService:
  """Runs a DDMLService app on its own event loop in a daemon thread."""

  def __init__(self, svc):
    from aiohttp import web
    self.svc = svc
    self.port = free_port()
    self.loop = asyncio.new_event_loop()
    self._ready = threading.Event()
    self._web = web
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()
    if not self._ready.wait(30):
      raise RuntimeError("service did not start")

  def _run(self):
    asyncio.set_event_loop(self.loop)
    self.runner = self._web.AppRunner(self.svc.make_app(), access_log=None)
    self.loop.run_until_complete(self.runner.setup())
    site = self._web.TCPSite(self.runner, "127.0.0.1", self.port)
    self.loop.run_until_complete(site.start())
    self._ready.set()
    self.loop.run_forever()

  @property
  def url(self):
    return f"http://127.0.0.1:{self.port}"

  def call(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

  def stop(self):
    self.call(self.runner.cleanup())
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join(10)


@pytest.fixture
def start_service():
  started = []

  def _start(svc):
    s = ThreadedService(svc)
    started.append(s)
    return s

  yield _start
  for s in started:
    s.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
  exe = shutil.which("redis-server")
  if exe is None:
    pytest.skip("redis-server binary not found (apt-get install -y redis-server; CI installs it)")
  port = free_port()
  d = tmp_path_factory.mktemp("redis")
  proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                           "--save", "", "--appendonly", "no"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 20
  while time.time() < deadline:
    try:
      with socket.create_connection(("127.0.0.1", port), timeout=0.2):
        break
    except OSError:
      time.sleep(0.05)
  else:
    proc.kill()
    raise RuntimeError("redis-server did not start")
  yield f"redis://127.0.0.1:{port}/0"
  proc.terminate()
  proc.wait(10)
