"""Review R (session 30): one accepted update per draw ticket when the verifying server's OWN
wall clock steps back after the ticket's first use.

Pihur et al., "Differentially-private 'Draw and Discard' machine learning" (Section IV): each
client update is one local-DP release from one draw. tickets.py checks a ticket's age by the
verifier's wall clock (valid while -max_skew_s <= age <= ttl_s); the store (store.replace) and
the process (replay_guard.ReplayGuard) remember a used nonce for `Tickets.nonce_ttl_s` =
ttl_s + max_skew_s of MONOTONIC time from its use. A wall clock stepped back by D after the
use (NTP correction, a VM restored, an operator) keeps the ticket valid D seconds longer by
the wall clock, while the nonce memory runs on the monotonic clock: for D > max_skew_s the
nonce is forgotten (monotonic use + ttl + skew) before the ticket expires (monotonic use +
ttl + D), and a second submit of the same ticket is accepted.

Measured at 854cb19 (ttl 60 s, max_skew_s 5 s, memory store and the process's ReplayGuard):
D = 30 s, second use 66 s after the first: 2 accepted updates from one draw (the replay window
is 65 s < t <= 90 s after the use). D <= 5 s, or a second use inside the window's bounds: 1.
A wall clock SLEWED (NTP: up to 500 ppm) slower than the monotonic one does the same in a
small window: a ticket admitted 4.999 s ahead, the second submit 65.02 s later (monotonic):
2 accepted (without the slew: 1).
"""

import asyncio

import numpy as np
import pytest

from tf_dpiter.draw_discard import replay_guard as replay_guard_lib
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard import tickets as tickets_lib

TTL, SKEW = 60.0, 5.0


def _accepted(step_back_s, wait_s, monkeypatch, ahead_s=0.0, wall_rate=1.0):
  """Updates the memory store and the process's replay guard accept from ONE ticket, verified
  by one server: issued by a clock `ahead_s` ahead of its wall clock (0: by itself), used at
  once, then the wall clock steps back by `step_back_s`, then the monotonic clock runs
  `wait_s` (the wall clock `wait_s * wall_rate`: NTP slews a clock by up to 500 ppm) and the
  ticket is submitted again."""
  clocks = {"wall": 1000.0, "mono": 50.0}
  monkeypatch.setattr(store_lib.time, "monotonic", lambda: clocks["mono"])
  tickets = tickets_lib.Tickets(b"k" * 32, TTL, clock=lambda: clocks["wall"], scope="m",
                                max_skew_s=SKEW)
  guard = replay_guard_lib.ReplayGuard(clock=lambda: clocks["mono"])
  store, drawn = store_lib.MemoryStore(), np.arange(4, dtype=np.float64)
  issuer = tickets_lib.Tickets(b"k" * 32, TTL, clock=lambda: clocks["wall"] + ahead_s,
                               scope="m")
  ticket = issuer.issue("alice", drawn)

  async def submit():
    try:
      nonce = tickets.verify(ticket, "alice", drawn)
      guard.check_nonce(nonce)
      await store.replace(0, drawn + 1.0, nonce, tickets.nonce_ttl_s)
      guard.used(nonce, tickets.nonce_ttl_s)
    except (tickets_lib.TicketError, store_lib.TicketUsed):
      return 0
    return 1

  async def both_submits():
    await store.initialize({"history": 0}, np.zeros((2, 4)))
    first = await submit()
    clocks["wall"] += wait_s * wall_rate - step_back_s
    clocks["mono"] += wait_s
    return first + await submit()

  return asyncio.run(both_submits())


@pytest.mark.parametrize("step_back_s, wait_s", [
    (0.0, TTL - 1.0), (0.0, TTL + 6.0),      # no step: remembered, then expired
    (SKEW, TTL + 6.0),                        # a step within the skew limit: nonce outlives it
    (30.0, 10.0),                             # the ticket now stamped 20 s ahead: refused
    (30.0, TTL + 4.0),                        # inside the nonce's memory: refused as used
])
def test_one_ticket_one_update_where_the_nonce_outlives_the_ticket(step_back_s, wait_s,
                                                                   monkeypatch):
  assert _accepted(step_back_s, wait_s, monkeypatch) == 1


# 854cb19: wall clock stepped back 30 s after the ticket's use, second submit 66 s later
# (ticket age 36 s < ttl 60 s, nonce remembered 65 s monotonic): 2 updates accepted from one
# draw. Fixed: the ticket clock (Tickets.now) never steps back.
@pytest.mark.parametrize("step_back_s, wait_s", [(30.0, TTL + 6.0), (600.0, 620.0)])
def test_a_wall_clock_stepped_back_opens_no_replay_window(step_back_s, wait_s, monkeypatch):
  assert _accepted(step_back_s, wait_s, monkeypatch) == 1


# 854cb19: a ticket 4.999 s ahead (within max_skew_s), the verifier's wall clock slewed 500 ppm
# slow: the second submit 65.02 s (monotonic) after the first was accepted (ticket age 59.989 s,
# nonce remembered 65 s). Fixed: the ticket clock runs at least as fast as the monotonic one.
def test_a_slewed_wall_clock_opens_no_replay_window(monkeypatch):
  assert _accepted(0.0, TTL + SKEW + 0.02, monkeypatch, ahead_s=4.999, wall_rate=1 - 5e-4) == 1


def test_the_slew_case_without_slew_is_refused(monkeypatch):
  assert _accepted(0.0, TTL + SKEW + 0.02, monkeypatch, ahead_s=4.999) == 1
