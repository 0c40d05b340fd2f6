"""The released model of the Draw and Discard service: what GET /v1/model may reveal.

Differencing the average of the k instances after each update would reveal each update
(bypassing the draw privacy of Pihur et al., "Differentially-Private Draw and Discard Machine
Learning", Section IV, adversaries I and II). So the average is released in batches: a new
release after >= `min_updates` updates AND >= `min_interval_s` seconds (one compare-and-set
in the store, shared by all its servers; integrity-tagged like a slot); reads are charged to
the draw quota. Residual: two consecutive releases differ by >= min_updates locally noised
updates; an attacker submitting all but one of them pays min_updates - 1 accepted submits
per victim update (docs/draw_discard_security.md, section 3).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from tf_dpiter import validation
from tf_dpiter.errors import ParameterValueError


@dataclasses.dataclass(frozen=True)
class Released:
  """A released model: the average of the k instances at store sequence number `seq`."""
  seq: int
  mean: np.ndarray


class MemoryRelease:
  """The release state of a MemoryStore (one process)."""

  def __init__(self):
    self._cur: tuple | None = None  # (seq, monotonic time, mean)

  def exchange(self, seq: int, mean: np.ndarray | None, min_updates: int,
               min_interval_s: float) -> tuple[Released | None, bool]:
    """Peek (mean None) or compare-and-set a release at `seq` (the store's sequence number now,
    or of `mean`): (the current release or None, whether a new one is due after min_updates
    updates and min_interval_s seconds since the last)."""
    now = time.monotonic()
    cur = self._cur
    due = cur is None or (seq >= cur[0] + min_updates and now - cur[1] >= min_interval_s)
    if due and mean is not None:
      self._cur = cur = (seq, now, mean)
      due = False
    return (None if cur is None else Released(cur[0], cur[2])), due


class ModelRelease:
  """Decides what GET /v1/model returns.

  Args:
    store: the service's store (MemoryStore or RedisStore).
    snapshots: the service's SnapshotCache.
    k: number of instances.
    min_updates: accepted updates between two releases (>= 1).
    min_interval_s: seconds between two releases (>= 0).

  Raises:
    ParameterValueError: for min_updates < 1, or min_interval_s < 0 or not finite.
  """

  def __init__(self, store, snapshots, k: int, min_updates: int, min_interval_s: float):
    validation.check_integer("model_min_updates", min_updates, 1)
    # finite: the Redis store keeps it in integer milliseconds
    validation.check_nonnegative("model_interval_s", min_interval_s, allow_inf=False,
                                 error=ParameterValueError)
    self.store, self.snapshots, self.k = store, snapshots, int(k)
    self.min_updates, self.min_interval_s = int(min_updates), float(min_interval_s)
    self._memory = MemoryRelease()

  async def _exchange(self, seq: int, mean: np.ndarray | None):
    if self.store.kind == "memory":
      return self._memory.exchange(seq, mean, self.min_updates, self.min_interval_s)
    return await self.store.release(seq, mean, self.k, self.min_updates, self.min_interval_s)

  async def current(self) -> Released:
    """The current Released model, making a new one when due.

    The peek uses the sequence number of touch() and the set that of a snapshot read
    since; when another request (or server) released a newer average in between, the store
    answers with that release (a benign race, never a rollback: only the store's own
    sequence number going back is one, redis_scripts.RELEASE).

    Raises:
      store.StoreLost, store.StoreUnavailable: store faults.
    """
    seq = await self.store.touch()
    rel, due = await self._exchange(seq, None)
    if rel is None or due:
      snap = await self.snapshots.refresh(seq)
      rel, _ = await self._exchange(snap.seq, snap.slots.mean(axis=0))
    return rel
