"""k-instance stores for the Draw and Discard service: in memory or Redis.

A store holds k slots (float64 little-endian weights), a short history of replaced
instances (the acceptance rule's candidates), a sequence number, counters and the meta. A
replacement is one atomic operation (no global lock). Integrity: initialization writes a
random *generation* with the meta in one transaction; every operation checks it first
(StoreLost when missing or different); the init lock expires (`lock_ttl_s`).
Obliviousness: there is no per-slot read; the service reads whole snapshots, and stores
never hold which slot was drawn (adversary II, Section IV).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import functools
import time
import uuid

import numpy as np

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError


COUNTERS = ("draws", "submits", "accepted", "rejected", "rejected_invalid")


def encode_weights(w: np.ndarray) -> bytes:
  """The little-endian float64 bytes (8 w.size) of a weight vector of any float dtype."""
  return np.ascontiguousarray(w, dtype="<f8").tobytes()


def decode_weights(b: bytes) -> np.ndarray:
  """Inverse of encode_weights: a read-only [len(b) / 8] float64 view."""
  return np.frombuffer(b, dtype="<f8")


class StoreMismatch(RuntimeError):
  """The shared store already holds a different model (version, size, spec or history)."""


class StoreLost(RuntimeError):
  """The store's data is gone or was re-initialized by someone else (generation check)."""


class StoreCorrupt(StoreLost):
  """A stored instance failed its integrity check (store_mac.py): length, tag, index."""


class StoreRolledBack(StoreLost):
  """The store's sequence number went below one this process already saw (a rollback,
  e.g. Redis restarted from an older snapshot): acknowledged updates were lost."""


class StoreUnavailable(RuntimeError):
  """The store cannot be reached (connection refused, timeout)."""


class StoreRefused(StoreUnavailable):
  """The store is up but refused the operation for now (Redis: memory full, persistence
  failing, loading, read-only replica, a long script): nothing was written (Redis refuses a
  script's write only before its first one)."""


class StoredNotAcknowledged(StoreUnavailable):
  """replace() wrote the update but could not anchor its sequence number (anchor.py: the
  anchor file or the store's epoch list failed): it is in the store, not acknowledged. The
  caller must count it as stored (influence budget, ticket) although the client gets 503."""


class WriteOutcomeUnknown(StoreUnavailable):
  """replace() sent the write and then failed without saying whether it landed (a timeout or a
  dropped connection after the write was sent): the update may be stored. The service keeps
  its step in the influence budget and answers 503 outcome_unknown; the client resends the
  same submission with the same ticket (its nonce makes a second write impossible)."""


class RateExceeded(RuntimeError):
  """replace() refused: the identity's influence rate across all servers is used up."""


class TicketUsed(RuntimeError):
  """replace() was given a draw-ticket nonce that an earlier accepted update already used."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """A consistent read: sequence number, slots [k, p] and replaced history [h, p].

  `combined`, when the store has it, is slots and history in one array (no copy needed).
  """
  seq: int
  slots: np.ndarray
  history: np.ndarray
  combined: np.ndarray | None = None

  @functools.cached_property
  def candidates(self) -> np.ndarray:
    """Slots then history, [k + h, p] float64 (cached)."""
    if self.combined is not None:
      return self.combined
    return np.concatenate([self.slots, self.history]) if len(self.history) else self.slots

  @functools.cached_property
  def centre(self) -> np.ndarray:
    """Mean of the k slots, [p] float64 (cached)."""
    return self.slots.mean(axis=0)


def check_instance(i, w, k: int, p: int) -> np.ndarray:
  """The [p] float64 instance `w` for slot `i` of a store of k slots, checked before a
  replace writes anything.

  Raises:
    ParameterTypeError: `i` is not an integer.
    ParameterValueError: `i` is not in 0..k-1, or `w` is not of shape [p].
  """
  validation.check_integer("i", i, 0, k - 1)
  w = np.asarray(w, dtype=np.float64)
  if w.shape != (p,):
    raise ParameterValueError(f"`w` must be an instance of shape ({p},). Received: "
                              f"w.shape={w.shape}")
  return w


META_KEYS = ("version", "k", "num_weights", "fingerprint", "history", "settings", "key_id")


def check_meta(existing: dict, wanted: dict) -> None:
  """Raises StoreMismatch naming the first key of META_KEYS where the store's `existing` meta
  and this server's `wanted` one differ.

  Raises:
    StoreMismatch: when any of META_KEYS differs.
  """
  for key in META_KEYS:
    if key == "settings":
      have, want = existing.get(key) or {}, wanted.get(key) or {}
      for name in sorted(set(have) | set(want)):
        if have.get(name) != want.get(name):
          raise StoreMismatch(
              f"store was initialized with setting {name}={have.get(name)!r}, this server "
              f"has {name}={want.get(name)!r}; every server of one store must use the same "
              "acceptance, ticket, quota and influence settings (or use a new prefix)")
    elif key == "key_id" and existing.get(key) != wanted.get(key):
      raise StoreMismatch(
          "store was initialized with another secret (key_id differs); start every server "
          "of one store with the same --key-file or $DDML_SECRET")
    elif existing.get(key) != wanted.get(key):
      raise StoreMismatch(
          f"store holds {key}={existing.get(key)!r}, this server wants {wanted.get(key)!r}; "
          "use a new prefix or --reset")


class Store(abc.ABC):
  """The interface of a k-instance store (abstract; `MemoryStore` and `RedisStore` are final).

  Every operation but `counters` and `close` first checks the generation (module docstring)
  and raises StoreLost when the store holds no model or another generation; every one
  raises StoreUnavailable when the backend does not answer.

  Attributes:
    kind: "memory" or "redis".
    generation: the random id of the model this store holds (None before `initialize`).
  """

  kind = None
  generation = None

  @property
  @abc.abstractmethod
  def scope(self) -> str:
    """The model held, for tickets.py: "memory:<generation>" or "redis:<prefix>:<generation>"."""

  @abc.abstractmethod
  async def meta(self) -> dict:
    """A copy of the stored meta dict."""

  @abc.abstractmethod
  async def touch(self, draws: int = 0) -> int:
    """Checks the generation, adds `draws` (served since the last store call) to the draw
    counter; returns the sequence number."""

  @abc.abstractmethod
  async def snapshot(self, previous: Snapshot | None = None) -> Snapshot:
    """A Snapshot: all slots and the history at one sequence number. Given an earlier
    snapshot `previous` of this store, only the history entries pushed since it are transferred
    (all k slots always are); the memory store ignores it: its arrays are views of the live
    store, to use before the next await (or copy)."""

  @abc.abstractmethod
  async def replace(self, i: int, w: np.ndarray, nonce: str | None = None,
                    nonce_ttl_s: float = 60.0, draws: int = 0, rate: tuple | None = None) -> int:
    """Overwrites slot i (the old value goes to the history); returns the new sequence number.

    Args:
      i: the slot.
      w: the new instance.
      nonce: a draw ticket's nonce, marked used (for nonce_ttl_s) in the same step; None: none.
      nonce_ttl_s: how long the nonce is remembered (the ticket's lifetime).
      draws: added to the draw counter (draws served since the last store call).
      rate: (identity, half_life_s, max_steps) or None: on Redis, refuse (RateExceeded) when
        the identity's decayed count of accepted updates would exceed max_steps across all
        servers; ignored in memory (one process: the service's influence budget holds it).

    Returns:
      The new sequence number.

    Raises:
      ParameterValueError: `i` is not in 0..k-1 or `w` is not of shape [p]; nothing written.
      TicketUsed: the nonce was used before, here or (Redis) by any server; nothing written.
      RateExceeded: over the identity's influence rate (Redis); nothing written.
      StoredNotAcknowledged: the anchor (anchor.py) cannot be written: the update is then
        stored, not acknowledged.
    """

  @abc.abstractmethod
  async def incr(self, name: str, n: int = 1) -> None:
    """Adds n to counter `name` (only while the store holds its model)."""

  @abc.abstractmethod
  async def counters(self) -> dict:
    """A dict of every COUNTERS key -> value, plus the sequence number as "seq"."""

  @abc.abstractmethod
  async def close(self) -> None:
    """Releases the store's connections (nothing in memory)."""


class MemoryStore(Store):
  """Embedded default store: one process, slots in a numpy array (final)."""

  kind = "memory"

  def __init__(self):
    self._rows: np.ndarray | None = None  # [k + history, p]: slots, then a ring of replaced ones
    self._k = self._n_hist = self._ptr = 0
    self._meta: dict | None = None
    self._seq = 0
    self._counters = dict.fromkeys(COUNTERS, 0)
    self.generation: str | None = None
    self._nonces: collections.OrderedDict = collections.OrderedDict()  # nonce -> expiry

  async def initialize(self, meta: dict, instances: np.ndarray, reset: bool = False) -> bool:
    """Writes meta (META_KEYS) and the [k, p] initial instances unless already initialized
    (with `reset`, overwrites an existing model): True if this call wrote the store, False if
    it joined.

    Raises:
      StoreMismatch: when joining a store that holds a different model.
    """
    if self._meta is not None and not reset:
      check_meta(self._meta, meta)
      return False
    self.generation = uuid.uuid4().hex
    k, p = np.shape(instances)
    self._rows = np.zeros((k + int(meta["history"]), p), dtype="<f8")
    self._rows[:k] = instances
    self._k, self._n_hist, self._ptr = k, 0, 0
    self._meta = dict(meta, generation=self.generation)
    self._seq = 0
    self._counters = dict.fromkeys(COUNTERS, 0)
    return True

  @property
  def scope(self) -> str:
    return f"memory:{self.generation}"

  def flush(self) -> None:
    """Drops all data, as a Redis FLUSHALL would (for fault tests)."""
    self._rows, self._meta = None, None

  def _check(self) -> None:
    if self._meta is None or self._meta.get("generation") != self.generation:
      raise StoreLost("memory store holds no model (flushed)")

  async def meta(self) -> dict:
    self._check()
    return dict(self._meta)

  async def touch(self, draws: int = 0) -> int:
    self._check()
    self._counters["draws"] += draws
    return self._seq

  async def snapshot(self, previous: Snapshot | None = None) -> Snapshot:
    self._check()
    k, n = self._k, self._n_hist
    return Snapshot(self._seq, self._rows[:k], self._rows[k:k + n], self._rows[:k + n])

  def _use_nonce(self, nonce: str, ttl_s: float) -> None:
    now = time.monotonic()
    while self._nonces and next(iter(self._nonces.values())) < now:
      self._nonces.popitem(last=False)
    if nonce in self._nonces:
      raise TicketUsed("draw ticket already used")
    self._nonces[nonce] = now + ttl_s

  async def replace(self, i: int, w: np.ndarray, nonce: str | None = None,
                    nonce_ttl_s: float = 60.0, draws: int = 0, rate: tuple | None = None) -> int:
    self._check()
    w = check_instance(i, w, self._k, self._rows.shape[1])
    if nonce is not None:
      self._use_nonce(nonce, nonce_ttl_s)
    self._counters["draws"] += draws
    h = self._rows.shape[0] - self._k
    if h:
      self._rows[self._k + self._ptr] = self._rows[i]
      self._ptr = (self._ptr + 1) % h
      self._n_hist = min(self._n_hist + 1, h)
    self._rows[i] = w
    self._seq += 1
    self._counters["submits"] += 1
    self._counters["accepted"] += 1
    return self._seq

  async def incr(self, name: str, n: int = 1) -> None:
    self._check()
    self._counters[name] = self._counters.get(name, 0) + n

  async def counters(self) -> dict:
    return dict(self._counters, seq=self._seq)

  async def close(self) -> None:
    pass   # nothing to release
