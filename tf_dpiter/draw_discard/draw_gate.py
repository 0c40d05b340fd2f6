"""Draw privacy at low traffic: a value is served only m updates away from every served one.

The attack: with rebasing a victim's update is stored as h' + d; a tracker served both h'
and h' + d learns d exactly (local DP its only protection). `DrawGate` keeps, per slot, the
lineage distance (h' + d is a child of h') from the slot's value to the nearest served value
(capped at m): a drawn slot at distance >= m is served, else its last served value is served
again (a *stale* draw, `draws_stale_total`). Any two distinct served values then differ by
a signed sum of >= m local-DP steps, at every traffic level (no formal amplification is
claimed). m = 1 is Algorithm 2 unchanged; without rebasing the gate is off.

The gate is per server process: a value another process wrote is placed conservatively
j = ceil(max_j |x_j - v_j| / linf) steps below the nearest known value v (distances never
overestimated); values present at start-up count as never served. Memory: about
(5 k + 128) p float64 values.
"""

from __future__ import annotations

import collections
import itertools
import math
import secrets

import numpy as np

from tf_dpiter import validation


SERVED_KEPT = 128  # served values a foreign value is compared with (most recent first)


def same_value(a: np.ndarray, b: np.ndarray) -> bool:
  """np.array_equal(a, b) of two [p] arrays, rejecting on the first coordinate before
  comparing all of them."""
  if a.size and b.size and a.flat[0] != b.flat[0]:
    return False
  return bool(np.array_equal(a, b))


class _Node:
  """One stored value: its id, its ancestors' ids (itself first, at most m) and `dist`."""

  __slots__ = ("chain", "dist", "value", "seq")

  def __init__(self, chain: tuple, dist: int, value: np.ndarray, seq: int):
    self.chain, self.dist, self.value, self.seq = chain, dist, value, seq


class DrawGate:
  """Serves a slot's value only when it is >= m lineage steps from every served value.

  Args:
    k: number of slots.
    m: minimum number of accepted updates between two served values (>= 1; 1: no gate).
    linf: per-weight bound of one accepted step (AcceptanceRule.linf), for placing values
      other processes wrote; None: such values count as one step from a served value.

  Raises:
    ParameterValueError: for k < 2 or m < 1.
  """

  def __init__(self, k: int, m: int, linf: float | None = None):
    validation.check_integer("k", k, 2)
    validation.check_integer("draw_min_updates", m, 1)
    self.k, self.m = int(k), int(m)
    self._ids = itertools.count(1)
    self._slots: list[_Node | None] = [None] * self.k
    self._pending: dict[int, list[_Node]] = {}
    self._served: list[np.ndarray | None] = [None] * self.k
    self._last_served: np.ndarray | None = None
    self._recent: collections.deque = collections.deque(maxlen=4 * self.k)
    self._served_nodes: collections.deque = collections.deque(maxlen=SERVED_KEPT)
    self.linf = linf
    self.stale = 0

  def _node(self, i: int, snap) -> _Node:
    """The lineage node of slot i's value in `snap` (registering values it did not write)."""
    node, value = self._slots[i], snap.slots[i]
    if node is not None and (node.seq > snap.seq or same_value(node.value, value)):
      return node
    for cand in self._pending.get(i, ()):
      if same_value(cand.value, value):
        return cand
    if node is None:  # first sight (start-up): never served by this process
      node = _Node((next(self._ids),), self.m, value.copy(), snap.seq)
    else:  # written by another process
      node = self._foreign(value, snap.seq)
    self._slots[i] = node
    self._recent.append(node)
    return node

  def _foreign(self, value: np.ndarray, seq: int) -> _Node:
    """A node for a value another process wrote: j steps below its closest known value."""
    if self.linf is None or not self._recent:
      return _Node((next(self._ids),), 1, value.copy(), seq)
    best, j = None, self.m
    for v in reversed(self._served_nodes):  # one step from a served value: the common case
      if float(np.max(np.abs(value - v.value))) <= self.linf:
        return _Node((next(self._ids),) + v.chain[:self.m - 1], 1, value.copy(), seq)
    for v in itertools.chain(self._recent, self._served_nodes):
      steps = max(1, math.ceil(float(np.max(np.abs(value - v.value))) / self.linf - 1e-9))
      if best is None or v.dist + steps < best.dist + j:
        best, j = v, steps
    if best.dist + j >= self.m:
      return _Node((next(self._ids),), self.m, value.copy(), seq)
    chain = tuple(next(self._ids) for _ in range(j)) + best.chain
    return _Node(chain[:self.m], best.dist + j, value.copy(), seq)

  @staticmethod
  def _distance(a: _Node, b: _Node, cap: int) -> int:
    pos = {x: n for n, x in enumerate(a.chain)}
    best = cap
    for n, x in enumerate(b.chain):
      if x in pos:
        best = min(best, pos[x] + n)
    return best

  def draw(self, snap) -> tuple[np.ndarray, bool]:
    """([p] copy of an instance, True when it is a stale, already served value) for a draw
    from Snapshot `snap`: slot i uniform, its value if m steps from all served ones."""
    i = secrets.randbelow(self.k)
    if self.m == 1:
      return snap.slots[i].copy(), False
    node = self._node(i, snap)
    if node.dist < self.m and self._last_served is not None:
      self.stale += 1
      old = self._served[i] if self._served[i] is not None else self._last_served
      return old.copy(), True
    node.dist = 0
    known = itertools.chain(self._slots, self._recent, *self._pending.values())
    for other in known:  # every node a later value may descend from or be placed under
      if other is not None and other is not node and other.dist > 0:
        other.dist = min(other.dist, self._distance(node, other, self.m))
    self._served[i] = self._last_served = node.value
    self._served_nodes.append(node)
    return node.value.copy(), False

  def parent(self, snap, i: int) -> _Node:
    """The opaque node (for `pending`) of slot i's value in `snap`, the base h' of a rebased
    update."""
    node, value = self._slots[i], snap.slots[i]
    if node is not None and node.seq > snap.seq and not same_value(node.value, value):
      # the snapshot is older than what this process wrote since: the base is an older value
      for v in itertools.chain(reversed(self._recent), reversed(self._served_nodes)):
        if same_value(v.value, value):
          return v
      return self._foreign(value, snap.seq)
    return self._node(i, snap)

  def pending(self, slot: int, value: np.ndarray, parent: _Node | None) -> _Node:
    """Registers the [p] value h' + d about to be written to `slot`, one update below `parent`
    (the base's node; None: unknown, e.g. not rebased: taken as served); returns the new node
    to pass to `written` or `dropped`."""
    if parent is None:
      chain, dist = (next(self._ids),), 1
    else:
      chain, dist = (next(self._ids),) + parent.chain[:self.m - 1], min(self.m, parent.dist + 1)
    node = _Node(chain, dist, np.asarray(value, dtype=np.float64).copy(), -1)
    if self.m == 1:
      return node
    self._pending.setdefault(slot, []).append(node)
    self._recent.append(node)
    return node

  def written(self, slot: int, node: _Node, seq: int) -> None:
    """The store replaced `slot` with the pending node's value at sequence number seq."""
    if self.m == 1:
      return
    self.dropped(slot, node)
    node.seq = seq
    cur = self._slots[slot]
    if cur is None or cur.seq <= seq:
      self._slots[slot] = node

  def dropped(self, slot: int, node: _Node) -> None:
    """Forgets a pending node of `slot` (the write failed, or it was recorded)."""
    cands = self._pending.get(slot)
    if cands and node in cands:
      cands.remove(node)
      if not cands:
        del self._pending[slot]
