"""A local anchor of the store's sequence number: detects a rollback across restarts.

The Redis store refuses a sequence number below the highest one its process has seen
(redis_store.py), but a restarted process starts from nothing. With an anchor file
(`serve --state-file PATH`, one per server, on the server's own disk) the server writes
{"generation", "seq"} once a second (write to a temporary file, fsync, rename) and at
shutdown, and at startup refuses a store of the same generation whose sequence number is
below the anchored one (StoreRolledBack): acknowledged updates were lost while it was down.
"""

from __future__ import annotations

import asyncio
import json
import os

from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.errors import ParameterValueError


class Anchor:
  """The anchor file of one server.

  Args:
    path: the file (created on the first save).
  """

  def __init__(self, path: str):
    self.path = path
    self._saved: tuple | None = None

  def load(self, generation: str) -> int:
    """The anchored sequence number for `generation` (0 when none or another generation).

    Args:
      generation: the store's generation.

    Returns:
      The sequence number.

    Raises:
      OSError: when the file exists but cannot be read.
      ValueError: when it is not an anchor file.
    """
    if not os.path.exists(self.path):
      return 0
    with open(self.path, encoding="utf-8") as f:
      data = json.load(f)
    if not isinstance(data, dict) or "generation" not in data or "seq" not in data:
      raise ParameterValueError(f"`state_file` {self.path!r} is not an anchor file; remove it or pass "
                                "another path")
    return int(data["seq"]) if data["generation"] == generation else 0

  def check(self, generation: str, seq: int) -> int:
    """Raises StoreRolledBack when the store is below the anchor; returns the anchor.

    Args:
      generation: the store's generation.
      seq: the store's sequence number now.

    Returns:
      The anchored sequence number (the process's starting high-water mark).

    Raises:
      store.StoreRolledBack: when seq is below the anchored sequence number.
    """
    anchored = self.load(generation)
    if seq < anchored:
      raise store_lib.StoreRolledBack(
          f"the store's sequence number is {seq}, below {anchored} recorded in "
          f"{self.path!r} by this server: the store was rolled back while it was down "
          "(acknowledged updates lost); check the store, then remove the file to accept it")
    return anchored

  def save(self, generation: str, seq: int) -> None:
    """Writes the anchor atomically (unchanged values are not rewritten).

    Args:
      generation: the store's generation.
      seq: the highest sequence number seen.
    """
    if self._saved == (generation, seq):
      return
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump({"generation": generation, "seq": int(seq)}, f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.path)
    self._saved = (generation, seq)

  async def run(self, store, every_s: float = 1.0) -> None:
    """Saves the store's high-water mark every `every_s` seconds (cancel to stop).

    Args:
      store: a RedisStore (its generation and high_water).
      every_s: seconds between saves.
    """
    while True:
      await asyncio.sleep(every_s)
      self.save(store.generation, store.high_water)
