"""Shared k-instance store on Redis (several server processes, one model per key prefix).

Keys: <prefix>:gen, :meta, :slot:<i>, :hist (replaced instances, newest first), :seq,
:counters, :init (lock with expiry), :nonce:<hex> (used tickets, expiring), :epochs and
:mark:<generation>:<anchor id> (anchor.py), :released (model_release.py). Every operation is one Lua script or MULTI transaction checking the generation
and the sequence high-water mark (redis_scripts.py); values carry integrity tags
(store_mac.py); used nonces and retired values are remembered (replay_guard.py). Faults are
sticky until a restart. With an anchor, replace() returns once the new sequence number is on
disk (group commit: redis_pipeline.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import uuid

import numpy as np
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from tf_dpiter import validation
from tf_dpiter.draw_discard import redis_pipeline
from tf_dpiter.draw_discard import replay_guard
from tf_dpiter.draw_discard import redis_scripts
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard import store_mac
from tf_dpiter.errors import ParameterValueError

_UNAVAILABLE = (redis_errors.ConnectionError, redis_errors.TimeoutError, ConnectionError,
                OSError, asyncio.TimeoutError)


# Error replies of a Redis that is up but refuses work for now (memory full, persistence
# failing on a full disk, loading, a replica, a long script): the store is unavailable, not lost.
_REFUSING = (redis_errors.OutOfMemoryError, redis_errors.ReadOnlyError,
             redis_errors.BusyLoadingError)
_REFUSING_PREFIXES = ("OOM", "MISCONF", "BUSY", "LOADING", "READONLY", "NOREPLICAS",
                      "MASTERDOWN")


def _refusal(url: str, e: BaseException) -> BaseException:
  """store.StoreRefused (a StoreUnavailable) for an error reply of a Redis refusing work for
  now (_REFUSING), store.StoreCorrupt for WRONGTYPE (a key of the model overwritten with
  another type), else `e` itself."""
  if isinstance(e, _REFUSING) or (isinstance(e, redis_errors.ResponseError)
                                  and str(e).startswith(_REFUSING_PREFIXES)):
    return store_lib.StoreRefused(f"redis {url}: {type(e).__name__}: {e}")
  if isinstance(e, redis_errors.ResponseError) and str(e).startswith("WRONGTYPE"):
    return store_lib.StoreCorrupt(f"redis {url}: a key of the model holds a value of another "
                                  f"type ({e})")
  return e


def _redact(url: str) -> str:
  """The URL without its password (redis://user:pw@host -> redis://user:***@host)."""
  parsed = urllib.parse.urlparse(url)
  if parsed.password is None:
    return url
  netloc = parsed.netloc.replace(":" + parsed.password + "@", ":***@", 1)
  return urllib.parse.urlunparse(parsed._replace(netloc=netloc))


class RedisStore(store_lib.Store):
  """Shared store on Redis (final).

  `replace` is one Lua script: generation and rollback checks, the identity's rate across all
  servers, the ticket nonce marked used (SET NX PX, so two servers cannot both accept one
  ticket), the write, the counters and the sequence number.

  Args:
    url: redis://host:port/db (rediss:// for TLS, unix:// for a socket).
    prefix: key prefix; one model per prefix.
    lock_ttl_s: expiry of the initialization lock.
    timeout_s: socket timeout of every Redis call.
    group_commit: send the touch/replace scripts of one event-loop iteration in one pipeline.

  Raises:
    ParameterValueError: for a URL of another scheme, or a lock_ttl_s not > 0.
  """

  kind = "redis"

  def __init__(self, url: str, prefix: str = "ddml", lock_ttl_s: float = 10.0,
               timeout_s: float = 2.0, group_commit: bool = True):
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("redis", "rediss", "unix"):
      raise ParameterValueError(f"store url must be redis://host:port/db, got {url!r}")
    validation.check_positive("lock_ttl_s", lock_ttl_s, error=ParameterValueError)
    self.url = _redact(url)  # for messages and logs: no password
    self.prefix = prefix
    self.lock_ttl_s = float(lock_ttl_s)
    self._r = aioredis.from_url(url, decode_responses=False, socket_timeout=timeout_s,
                                socket_connect_timeout=timeout_s)
    self._touch = self._r.register_script(redis_scripts.TOUCH)
    self._replace = self._r.register_script(redis_scripts.REPLACE)
    self._snapshot = self._r.register_script(redis_scripts.SNAPSHOT)
    self._quota = self._r.register_script(redis_scripts.QUOTA)
    self._incr = self._r.register_script(redis_scripts.INCR)
    self._release = self._r.register_script(redis_scripts.RELEASE)
    self._epoch = self._r.register_script(redis_scripts.EPOCH)
    self.anchor = None  # anchor.Anchor: replace() returns once its seq is anchored
    self.guard = replay_guard.ReplayGuard()
    self.generation: str | None = None
    self.integrity_key: bytes | None = None  # set by the service before initialize
    self.high_water = 0  # highest sequence number this process has seen
    self._lost: store_lib.StoreLost | None = None  # sticky fault
    self._p = 0
    self._k_slots: list[str] = []
    self._history = 0
    self.group_commit = bool(group_commit)
    self._pipeline = redis_pipeline.GroupCommit(self._r, self.url, _UNAVAILABLE,
                                                lambda e: _refusal(self.url, e))

  @property
  def scope(self) -> str:
    return f"redis:{self.prefix}:{self.generation}"

  def _k(self, *parts) -> str:
    return ":".join((self.prefix,) + tuple(str(p) for p in parts))

  async def _call(self, coro):
    try:
      return await coro
    except _UNAVAILABLE as e:
      raise store_lib.StoreUnavailable(f"redis {self.url}: {type(e).__name__}: {e}") from e
    except redis_errors.ResponseError as e:
      err = _refusal(self.url, e)
      if err is e:
        raise
      raise err from e

  async def _batched(self, script, keys, args):
    """Runs `script` in the next pipeline of this event-loop iteration; returns its reply."""
    if not self.group_commit:
      return await self._call(script(keys=keys, args=args))
    return await self._pipeline.run(script, keys, args)

  def _fail(self, err: store_lib.StoreLost):
    self._lost = err
    raise err

  def _ok(self) -> None:
    if self._lost is not None:
      raise type(self._lost)(str(self._lost))

  def _result(self, code: int) -> int:
    if code == -1:
      self._fail(store_lib.StoreLost(
          f"redis store {self.url} prefix {self.prefix!r} holds no model (flushed, a key "
          "deleted, or restarted without persistence)"))
    if code == -2:
      self._fail(store_lib.StoreLost(
          f"redis store prefix {self.prefix!r} was re-initialized by another server "
          "(generation changed); restart this server"))
    if code == -4:
      self._fail(store_lib.StoreRolledBack(
          f"redis store prefix {self.prefix!r} went back below sequence number "
          f"{self.high_water} (restored from an older snapshot?): acknowledged updates are "
          "lost and used tickets forgotten; restart this server after checking the store"))
    if code == -6:
      self._fail(store_lib.StoreCorrupt(
          f"redis store prefix {self.prefix!r}: a key of the model (history, counters, rate "
          "or sequence number) holds a value of another type; nothing was written"))
    self.high_water = max(self.high_water, int(code))
    return int(code)

  async def initialize(self, meta: dict, instances: np.ndarray, reset: bool = False,
                       wait_s: float = 30.0) -> bool:
    """The first process initializes (SET NX EX on <prefix>:init) with meta (store.META_KEYS)
    and the [k, p] initial instances (with `reset`, deleting an existing model first); the
    others join, waiting up to wait_s for the initializer. True if this call wrote the store,
    False if it joined.

    Raises:
      StoreMismatch: when joining a store that holds a different model.
      TimeoutError: when no model appears within wait_s.
      StoreUnavailable: when Redis cannot be reached.
    """
    k = int(meta["k"])
    self._p = int(meta["num_weights"])
    if self.integrity_key is None:
      raise ParameterValueError("RedisStore.integrity_key must be set (keys.derive) before initialize")
    self._k_slots = [self._k("slot", i) for i in range(k)]
    self._history = int(meta["history"])
    return await self._call(self._initialize(meta, instances, reset, wait_s))

  async def _initialize(self, meta, instances, reset, wait_s) -> bool:
    r = self._r
    if reset:
      await r.delete(self._k("init"), self._k("gen"), self._k("meta"), self._k("counters"),
                     self._k("hist"), self._k("seq"), self._k("epochs"), self._k("released"),
                     *self._k_slots)
    deadline = time.monotonic() + wait_s
    while True:
      if await r.exists(self._k("gen")):
        existing = json.loads(await r.get(self._k("meta")) or b"{}")
        store_lib.check_meta(existing, meta)
        self.generation = existing["generation"]
        return False
      token = uuid.uuid4().hex
      if await r.set(self._k("init"), token, nx=True, px=int(self.lock_ttl_s * 1000)):
        if await r.exists(self._k("gen")):  # initialized between our check and our lock
          await r.delete(self._k("init"))
          continue
        gen = uuid.uuid4().hex
        pipe = r.pipeline(transaction=True)
        for i, (key, row) in enumerate(zip(self._k_slots, instances)):
          pipe.set(key, store_mac.seal(self.integrity_key, gen, i, row))
        pipe.set(self._k("meta"), json.dumps(dict(meta, generation=gen)).encode())
        # every key of a model (the released average included: its sequence number would
        # read as a rollback of the new model's)
        pipe.delete(self._k("counters"), self._k("hist"), self._k("epochs"), self._k("released"))
        pipe.set(self._k("seq"), 0)
        pipe.set(self._k("gen"), gen)
        pipe.delete(self._k("init"))
        await pipe.execute()
        self.generation = gen
        return True
      if time.monotonic() > deadline:
        raise TimeoutError(f"redis store {self.url} prefix {self.prefix!r}: no model after "
                           f"{wait_s}s (another server holds the init lock)")
      await asyncio.sleep(0.05)

  async def shared_secret(self, candidate: bytes) -> bytes:
    """Legacy mode (keys.py): the secret every server of this prefix uses, kept in the store
    (`candidate`, a fresh random secret, if none is yet). Anyone who can read the store can
    read it: forged tickets and slot tags become possible."""
    key = self._k("legacy_secret")
    await self._call(self._r.set(key, candidate, nx=True))
    return await self._call(self._r.get(key))

  async def meta(self) -> dict:
    raw = await self._call(self._r.get(self._k("meta")))
    if not raw:
      self._result(-1)
    return json.loads(raw)

  async def touch(self, draws: int = 0) -> int:
    self._ok()
    code = await self._batched(self._touch, [self._k("gen"), self._k("seq"),
                                             self._k("counters")],
                               [self.generation, int(draws), self.high_water])
    return self._result(code)

  async def snapshot(self, previous: store_lib.Snapshot | None = None) -> store_lib.Snapshot:
    self._ok()
    prev_seq = previous.seq if previous is not None else -1
    out = await self._call(self._snapshot(
        keys=[self._k("gen"), self._k("seq"), self._k("hist"), *self._k_slots],
        args=[self.generation, prev_seq, self._history, self.high_water]))
    if len(out) == 1:
      self._result(int(out[0]))
    seq, full, slots, hist = self._result(int(out[0])), int(out[1]), out[2], out[3]
    p, k = self._p, len(slots)
    try:
      raw = (store_mac.open_many(self.integrity_key, self.generation, slots, p, list(range(k)))
             + store_mac.open_many(self.integrity_key, self.generation, hist, p))
    except store_lib.StoreCorrupt as e:
      self._fail(store_lib.StoreCorrupt(f"redis store prefix {self.prefix!r}: {e}"))
    replayed = self.guard.replayed_slot(slots, p, seq)
    if replayed is not None:
      self._fail(store_lib.StoreCorrupt(
          f"redis store prefix {self.prefix!r}: slot {replayed} holds a value that an earlier "
          "update replaced (an older value written back into the store)"))
    new = np.frombuffer(raw, dtype="<f8").reshape(k + len(hist), p)
    if full or previous is None:
      return store_lib.Snapshot(seq, new[:k], new[k:], new)
    keep = previous.history[:max(0, self._history - len(hist))]
    rows = np.concatenate([new, keep])
    return store_lib.Snapshot(seq, rows[:k], rows[k:], rows)

  async def replace(self, i: int, w: np.ndarray, nonce: str | None = None,
                    nonce_ttl_s: float = 60.0, draws: int = 0,
                    rate: tuple | None = None) -> int:
    self._ok()
    w = store_lib.check_instance(i, w, len(self._k_slots), self._p)
    if nonce is not None:
      self.guard.check_nonce(nonce)
    ident, half_life, max_steps = rate if rate is not None else ("-", 1.0, None)
    code = await self._batched(
        self._replace,
        [self._k("gen"), self._k_slots[i], self._k("hist"), self._k("seq"), self._k("counters"),
         self._k("nonce", nonce or "-"), self._k("rate", ident)],
        [self.generation, store_mac.seal(self.integrity_key, self.generation, i, w),
         self._history, nonce or "", max(1, int(nonce_ttl_s * 1000)), int(draws),
         self.high_water, repr(float(half_life) * 1000.0),
         "" if max_steps is None else repr(float(max_steps))])
    if code == -3:
      raise store_lib.TicketUsed("draw ticket already used")
    if code == -5:
      raise store_lib.RateExceeded("influence rate exceeded (all servers)")
    old_id = None
    if isinstance(code, list):  # {seq, write id of the replaced value}
      code, old_id = code
    seq = self._result(code)
    if old_id is not None:
      self.guard.retire(old_id, seq)
    if nonce is not None:
      self.guard.used(nonce, nonce_ttl_s)
    if self.anchor is not None:
      try:
        await self.anchor.commit(self, seq)
      except store_lib.StoreUnavailable as e:  # written above: stored, not acknowledged
        raise store_lib.StoredNotAcknowledged(str(e)) from e
    return seq

  async def epochs(self, new_epoch: str | None = None,
                   mark: tuple[str, int] | None = None) -> tuple[int, int, str]:
    """(sequence number, length of the epoch list, its last entry or "") of the store
    (anchor.py), after appending `new_epoch` as "<id>:<seq>" (a server start; None: only read)
    and raising the mark of anchor `mark[0]` to `mark[1]`, the sequence number it is about to
    record (`anchor_mark`; None: no mark).

    Raises:
      StoreLost, StoreRolledBack, StoreUnavailable.
    """
    self._ok()
    out = await self._call(self._epoch(
        keys=[self._k("gen"), self._k("seq"), self._k("epochs"),
              self._k("mark", self.generation, mark[0] if mark else "-")],
        args=[self.generation, self.high_water, new_epoch or "",
              "" if mark is None else int(mark[1])]))
    seq = self._result(int(out[0]))
    return seq, int(out[1]), out[2].decode() if isinstance(out[2], bytes) else str(out[2])

  async def anchor_mark(self, anchor_id: str) -> int | None:
    """The highest sequence number anchor `anchor_id` recorded in this generation, as the
    store holds it (`epochs`); None when the store holds none (anchor.py).

    Raises:
      StoreCorrupt: the mark is not an integer.
      StoreUnavailable: Redis does not answer.
    """
    raw = await self._call(self._r.get(self._k("mark", self.generation, anchor_id)))
    if raw is None:
      return None
    try:
      return int(raw)
    except ValueError:
      self._fail(store_lib.StoreCorrupt(f"redis store prefix {self.prefix!r}: the mark of "
                                        f"anchor {anchor_id} is not an integer"))

  async def epoch_entries(self, start: int) -> list[str]:
    """The "<id>:<seq>" entries of the epoch list from index `start` on (anchor.py).

    Raises:
      StoreUnavailable: Redis does not answer.
    """
    raw = await self._call(self._r.lrange(self._k("epochs"), int(start), -1))
    return [e.decode() for e in raw]

  async def release(self, seq: int, mean: np.ndarray | None, k: int, min_updates: int,
                    min_interval_s: float):
    """Peeks at (mean None) or compare-and-sets the released model (model_release.py):
    (model_release.Released or None, whether a new release is due). `seq` is the sequence
    number now (peek) or of the [p] `mean` (set); the release is tagged as slot index k and is
    due after min_updates updates and min_interval_s seconds (Redis clock) since the last. A
    `seq` below the current release's is a benign race: the current release is returned.

    Raises:
      StoreLost, StoreCorrupt, StoreRolledBack, StoreUnavailable.
    """
    from tf_dpiter.draw_discard import model_release  # pylint: disable=g-import-not-at-top
    self._ok()
    payload = b"" if mean is None else store_mac.seal(self.integrity_key, self.generation, k,
                                                        mean)
    out = await self._call(self._release(
        keys=[self._k("gen"), self._k("released"), self._k("seq")],
        args=[self.generation, int(seq), payload, int(min_updates),
              int(min_interval_s * 1000), self.high_water]))
    if int(out[0]) == -5:
      return None, True
    if int(out[0]) < 0:
      self._result(int(out[0]))
    try:
      raw = store_mac.open_many(self.integrity_key, self.generation, [out[1]], self._p, [k])
    except store_lib.StoreCorrupt as e:
      self._fail(store_lib.StoreCorrupt(f"redis store prefix {self.prefix!r} released model: {e}"))
    return model_release.Released(int(out[0]), np.frombuffer(raw, dtype="<f8")), bool(out[2])

  async def take_quota(self, identity: str, op: str, rate: float, burst: float) -> float:
    """Takes one request of (identity, op) from a token bucket (rate per second, size burst)
    shared by every server of this store: 0.0 when allowed, else the seconds until the next
    request would be (Redis clock)."""
    wait_ms = await self._batched(self._quota, [self._k("quota", op, identity)],
                                  [repr(float(rate)), repr(float(burst))])
    return int(wait_ms) / 1000.0

  async def incr(self, name: str, n: int = 1) -> None:
    self._ok()
    code = await self._call(self._incr(keys=[self._k("gen"), self._k("counters")],
                                       args=[self.generation, name, int(n)]))
    if code == -1:
      self._result(-1)

  async def counters(self) -> dict:
    pipe = self._r.pipeline(transaction=False)
    pipe.hgetall(self._k("counters"))
    pipe.get(self._k("seq"))
    raw, seq = await self._call(pipe.execute())
    out = dict.fromkeys(store_lib.COUNTERS, 0)
    out.update({k.decode(): int(v) for k, v in raw.items()})
    out["seq"] = int(seq or 0)
    return out

  async def close(self) -> None:
    await self._r.aclose()
