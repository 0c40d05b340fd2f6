"""What one server process remembers about a shared store, against replays by its writers.

A Redis writer without the secret cannot forge tickets or sealed values but can delete keys
and write old values back. Kept in the server's memory: used ticket nonces for the ticket's
lifetime (at most `max_nonces`), and the write ids of the values this process replaced with
the replacing update's sequence number (at most `max_retired`): a snapshot at s holding a
value replaced at or before s shows a write-back. Per process; lost on restart.
"""

from __future__ import annotations

import collections
import time

from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard import store_mac


class ReplayGuard:
  """Used nonces and retired write ids of one process.

  Args:
    max_nonces: used nonces remembered (oldest forgotten first).
    max_retired: retired write ids remembered (oldest forgotten first).
    clock: monotonic time source in seconds (tests).
  """

  def __init__(self, max_nonces: int = 1_000_000, max_retired: int = 1 << 18,
               clock=time.monotonic):
    self.max_nonces, self.max_retired, self._clock = int(max_nonces), int(max_retired), clock
    self._nonces: collections.OrderedDict = collections.OrderedDict()  # nonce -> expiry
    self._retired: collections.OrderedDict = collections.OrderedDict()  # write id -> seq

  def check_nonce(self, nonce: str) -> None:
    """Raises TicketUsed for a ticket nonce (hex) this process accepted within its lifetime.

    Raises:
      store.TicketUsed: the nonce was used here.
    """
    now, used = self._clock(), self._nonces
    while used and (next(iter(used.values())) < now or len(used) > self.max_nonces):
      used.popitem(last=False)
    if nonce in used:
      raise store_lib.TicketUsed("draw ticket already used (this server)")

  def used(self, nonce: str, ttl_s: float) -> None:
    """Records an accepted ticket's nonce for `ttl_s` seconds (the ticket's lifetime)."""
    self._nonces[nonce] = self._clock() + float(ttl_s)

  def retire(self, write_id: bytes, seq: int) -> None:
    """Records that update `seq` replaced the value carrying `write_id` (store_mac.py)."""
    self._retired[bytes(write_id)] = int(seq)
    while len(self._retired) > self.max_retired:
      self._retired.popitem(last=False)

  def replayed_slot(self, slots: list, p: int, seq: int) -> int | None:
    """The first slot index of a snapshot at `seq` (slots: its sealed values of p weights,
    already checked by store_mac.open_many) holding a value retired at or before `seq`; None
    when there is none."""
    if not self._retired:
      return None
    for i, wid in enumerate(store_mac.write_ids(slots, p)):
      retired_at = self._retired.get(wid)
      if retired_at is not None and retired_at <= seq:
        return i
    return None
