"""k-instance stores for the Draw and Discard service: in memory or Redis.

A store holds k slots of float64 little-endian weight bytes, the model meta (version,
k, num_weights, spec JSON) and counters. There is no global lock: each slot is written
by one atomic operation (a Python assignment on the event loop; a Redis SET), as the
paper's memcache/datastore entities (Section I, "hotspotting"). Several server processes
may share one Redis store: the multi-machine path.

Stores never hold which slot was drawn by which client (adversaries II/III, Section IV).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse

import numpy as np

COUNTERS = ("draws", "submits", "accepted", "rejected_spam", "rejected_invalid")


def encode_weights(w: np.ndarray) -> bytes:
  return np.ascontiguousarray(w, dtype="<f8").tobytes()


def decode_weights(b: bytes) -> np.ndarray:
  return np.frombuffer(b, dtype="<f8")


class StoreMismatch(RuntimeError):
  """The shared store already holds a different model version or shape."""


class MemoryStore:
  """Embedded default store: one process, slots in a Python list."""

  kind = "memory"

  def __init__(self):
    self._slots: list[bytes] = []
    self._meta: dict | None = None
    self._counters = dict.fromkeys(COUNTERS, 0)

  async def initialize(self, meta: dict, instances: np.ndarray, reset: bool = False) -> bool:
    """Writes meta and the k initial instances unless already initialized. True if written."""
    if self._meta is not None and not reset:
      _check_meta(self._meta, meta)
      return False
    self._slots = [encode_weights(r) for r in instances]
    self._meta = dict(meta)
    self._counters = dict.fromkeys(COUNTERS, 0)
    return True

  async def meta(self) -> dict:
    return dict(self._meta)

  async def draw(self, i: int) -> bytes:
    self._counters["draws"] += 1
    return self._slots[i]

  async def replace(self, i: int, data: bytes) -> None:
    self._slots[i] = data  # one atomic assignment: no lock
    self._counters["submits"] += 1
    self._counters["accepted"] += 1

  async def all_slots(self) -> list[bytes]:
    return list(self._slots)

  async def incr(self, name: str, n: int = 1) -> None:
    self._counters[name] = self._counters.get(name, 0) + n

  async def counters(self) -> dict:
    return dict(self._counters)

  async def close(self) -> None:
    pass


class RedisStore:
  """Shared store on Redis: keys <prefix>:slot:<i>, <prefix>:meta, <prefix>:counters."""

  kind = "redis"

  def __init__(self, url: str, prefix: str = "ddml"):
    import redis.asyncio as aioredis  # pylint: disable=g-import-not-at-top
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("redis", "rediss", "unix"):
      raise ValueError(f"store url must be redis://host:port/db, got {url!r}")
    self.url = url
    self.prefix = prefix
    self._r = aioredis.from_url(url, decode_responses=False)

  def _k(self, *parts) -> str:
    return ":".join((self.prefix,) + tuple(str(p) for p in parts))

  async def initialize(self, meta: dict, instances: np.ndarray, reset: bool = False,
                       wait_s: float = 30.0) -> bool:
    """First process initializes (SET NX on <prefix>:init); the others wait for <prefix>:ready."""
    r = self._r
    if reset:
      await r.delete(self._k("init"), self._k("ready"), self._k("meta"), self._k("counters"),
                     *[self._k("slot", i) for i in range(int(meta["k"]))])
    if await r.set(self._k("init"), b"1", nx=True):
      pipe = r.pipeline(transaction=True)
      for i, row in enumerate(instances):
        pipe.set(self._k("slot", i), encode_weights(row))
      pipe.set(self._k("meta"), json.dumps(meta).encode())
      pipe.delete(self._k("counters"))
      pipe.set(self._k("ready"), b"1")
      await pipe.execute()
      return True
    deadline = time.monotonic() + wait_s
    while not await r.exists(self._k("ready")):
      if time.monotonic() > deadline:
        raise TimeoutError(f"redis store {self.url} prefix {self.prefix!r}: not ready after {wait_s}s")
      await asyncio.sleep(0.05)
    _check_meta(await self.meta(), meta)
    return False

  async def meta(self) -> dict:
    raw = await self._r.get(self._k("meta"))
    return json.loads(raw) if raw else {}

  async def draw(self, i: int) -> bytes:
    pipe = self._r.pipeline(transaction=False)
    pipe.get(self._k("slot", i))
    pipe.hincrby(self._k("counters"), "draws", 1)
    data, _ = await pipe.execute()
    return data

  async def replace(self, i: int, data: bytes) -> None:
    pipe = self._r.pipeline(transaction=False)
    pipe.set(self._k("slot", i), data)  # one atomic SET per slot: no lock
    pipe.hincrby(self._k("counters"), "submits", 1)
    pipe.hincrby(self._k("counters"), "accepted", 1)
    await pipe.execute()

  async def all_slots(self) -> list[bytes]:
    k = int((await self.meta())["k"])
    return await self._r.mget([self._k("slot", i) for i in range(k)])

  async def incr(self, name: str, n: int = 1) -> None:
    await self._r.hincrby(self._k("counters"), name, n)

  async def counters(self) -> dict:
    raw = await self._r.hgetall(self._k("counters"))
    out = dict.fromkeys(COUNTERS, 0)
    out.update({k.decode(): int(v) for k, v in raw.items()})
    return out

  async def close(self) -> None:
    await self._r.aclose()


def _check_meta(existing: dict, wanted: dict) -> None:
  for key in ("version", "k", "num_weights"):
    if existing.get(key) != wanted.get(key):
      raise StoreMismatch(
          f"store holds {key}={existing.get(key)!r}, this server wants {wanted.get(key)!r}; "
          "use a new prefix or reset")


def make_store(spec: str, prefix: str = "ddml"):
  """'memory' -> MemoryStore; 'redis://host:port/db' -> RedisStore."""
  if spec == "memory":
    return MemoryStore()
  if spec.startswith(("redis://", "rediss://", "unix://")):
    return RedisStore(spec, prefix=prefix)
  raise ValueError(f"store must be 'memory' or 'redis://host:port/db', got {spec!r}")
