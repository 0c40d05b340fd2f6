"""Oblivious snapshots of the k instances: a draw reads all k slots (store.Snapshot) and picks
one locally, so the store never learns which was served. A new snapshot is read when the
in-memory store's generation moved, or once the last Redis read is older than `max_age_s`
(one read in flight per process).
"""

from __future__ import annotations

import asyncio
import time

from tf_dpiter.draw_discard import metrics as metrics_lib
from tf_dpiter.draw_discard import store as store_lib


class SnapshotCache:
  """The last full read of the store's k slots, refreshed on demand.

  Args:
    store: a MemoryStore or RedisStore (its `kind` is "memory" or "redis").
    metrics: the process's metrics registry (counts `snapshot_refreshes_total`).
    max_age_s: seconds a Redis snapshot may serve draws after the store moved on.
  """

  def __init__(self, store, metrics: metrics_lib.Registry, max_age_s: float):
    self.store = store
    self.metrics = metrics
    self.max_age_s = float(max_age_s)
    self._snap: store_lib.Snapshot | None = None
    self._time = -1e30
    self._lock = asyncio.Lock()

  def _stale(self) -> bool:
    return time.monotonic() - self._time > self.max_age_s

  async def refresh(self, seq: int) -> store_lib.Snapshot:
    """The snapshot, read again unless the cached one is already at or past generation `seq`."""
    async with self._lock:  # coalesce: one refresh in flight
      if self._snap is None or self._snap.seq < seq:
        self._snap = await self.store.snapshot(self._snap)
        self._time = time.monotonic()
        self.metrics.inc("snapshot_refreshes_total", help_text="full reads of the k slots")
    return self._snap

  async def at(self, seq: int) -> store_lib.Snapshot:
    """The last snapshot, or a new one when the store (now at generation `seq`) moved past it:
    memory store, whenever the generation differs; Redis, once the last one is older than
    `max_age_s`."""
    snap = self._snap
    if snap is None or (snap.seq != seq and (self.store.kind == "memory" or self._stale())):
      snap = await self.refresh(seq)
    return snap

  async def for_draw(self) -> store_lib.Snapshot:
    """Counts one draw in the store and returns a snapshot fresh enough to serve it."""
    return await self.at(await self.store.touch(draws=1))

  async def recent(self) -> store_lib.Snapshot:
    """The last snapshot if younger than `max_age_s` (memory: always current), else a new one."""
    snap = self._snap
    if snap is None or (self.store.kind != "memory" and self._stale()):
      snap = await self.refresh(snap.seq + 1 if snap is not None else 0)
    return snap

  async def current(self) -> store_lib.Snapshot:
    """The cached snapshot whatever its age (read once if there is none)."""
    return self._snap if self._snap is not None else await self.refresh(0)
