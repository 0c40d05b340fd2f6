"""Review R (session 29): one accepted update per draw ticket, when clocks differ.

Pihur et al., "Differentially-private 'Draw and Discard' machine learning" (Section IV):
each client update is one local-DP release from one draw. The service enforces it with a
ticket (tickets.py: MAC over the drawn instance and the issue time, valid `ttl_s` after its
draw by the verifier's wall clock) and a nonce the store remembers for `ticket_ttl_s` from
its USE (store.replace; the memory store on time.monotonic, Redis with PX). A ticket stamped
in the verifier's future (another server of the same store whose clock is ahead, or this
server's wall clock stepped back) stayed valid longer than its nonce was remembered (07f4c0a:
skew 30 s, ttl 60 s: 2 accepted updates from one draw). Now a ticket stamped more than
`max_skew_s` ahead is refused (409 ticket_from_future) and the service remembers the nonce
for `Tickets.nonce_ttl_s` = ttl_s + max_skew_s, the longest a ticket admitted once stays valid.
"""

import asyncio

import numpy as np
import pytest

from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard import tickets as tickets_lib

TTL = 60.0


def _replays(skew_s, wait_s=TTL + 1.0):
  """Uses of one ticket the store accepts (the service's contract: the nonce remembered
  `verifier.nonce_ttl_s`): issued by a clock `skew_s` ahead of the verifier's, used at once,
  then again `wait_s` later by both clocks."""
  wall = [1000.0]
  mono = [50.0]
  issuer = tickets_lib.Tickets(b"k" * 32, TTL, clock=lambda: wall[0] + skew_s, scope="m")
  verifier = tickets_lib.Tickets(b"k" * 32, TTL, clock=lambda: wall[0], scope="m")
  h = np.arange(4, dtype=np.float64)
  ticket = issuer.issue("alice", h)
  store = store_lib.MemoryStore()
  accepted = 0

  async def go():
    nonlocal accepted
    await store.initialize({"history": 0}, np.zeros((2, 4)))
    for _ in range(2):
      try:
        nonce = verifier.verify(ticket, "alice", h)
        await store.replace(0, h + 1.0, nonce, verifier.nonce_ttl_s)
      except (tickets_lib.TicketError, store_lib.TicketUsed):
        pass
      else:
        accepted += 1
      wall[0] += wait_s          # both clocks run on
      mono[0] += wait_s

  real = store_lib.time.monotonic
  store_lib.time.monotonic = lambda: mono[0]
  try:
    asyncio.run(go())
  finally:
    store_lib.time.monotonic = real
  return accepted


def test_one_ticket_one_update_with_equal_clocks():
  assert _replays(0.0) == 1


def test_a_ticket_from_beyond_the_skew_limit_is_refused():
  """30 s ahead, limit 5 s (default): refused at its first use (nothing stored, the nonce not
  marked), admitted 61 s later (age 31 s): one update from one draw."""
  assert _replays(30.0) == 1
  assert _replays(30.0, wait_s=2 * TTL) == 0     # refused, then expired: none


@pytest.mark.parametrize("wait_s", [TTL - 1.0, TTL + 1.0, TTL + 4.0, TTL + 6.0])
def test_one_ticket_one_update_when_the_issuers_clock_is_ahead_within_the_limit(wait_s):
  """4.9 s ahead: admitted once; the second use, at any later time, is refused (the nonce is
  remembered 65 s, the ticket valid 64.9 s after its first use)."""
  assert _replays(4.9, wait_s) == 1


def test_the_refusal_names_the_skew():
  issuer = tickets_lib.Tickets(b"k" * 32, TTL, clock=lambda: 1030.0, scope="m")
  verifier = tickets_lib.Tickets(b"k" * 32, TTL, clock=lambda: 1000.0, scope="m")
  h = np.zeros(3)
  with pytest.raises(tickets_lib.TicketError, match="30 s ahead") as e:
    verifier.verify(issuer.issue("a", h), "a", h)
  assert (e.value.status, e.value.code) == (409, "ticket_from_future")
  assert verifier.nonce_ttl_s == TTL + 5.0
  with pytest.raises(Exception, match="max_skew_s"):
    tickets_lib.Tickets(b"k" * 32, TTL, max_skew_s=-1.0)
