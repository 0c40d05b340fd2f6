"""Resends of a submit whose outcome is unknown: charged once, and never without a ticket.

1. A write that did not land (the store timed out before taking it) is answered 503
   outcome_unknown and its step stays in the influence budget (it might have landed). Before:
   the resend with the same ticket was admitted again, so the identity's budget counted 2
   steps for 1 stored update. Now a resend of the same submission (same ticket, same step)
   takes over the first send's charge: 1 step in total whichever send stored it; a resend
   with another step under the same ticket is charged for its own step as well (never less
   than what may be stored).
2. A server without tickets does not dedupe: before, the client resent a submission once
   after a dropped connection, and the server stored the same noisy update twice. Now the
   client resends after a dropped connection only a draw whose server said that it checks
   tickets (X-DDML-Resend: same_ticket), and otherwise raises SubmitOutcomeUnknown.
"""

import asyncio
import json
import time

import numpy as np
import pytest

from tf_dpiter.draw_discard import admission, cli, client, client_lib, client_wire, service, sybil
from tf_dpiter.draw_discard import store as store_lib
from tests.draw_discard.conftest import http_request
from tests.draw_discard.loopback import BoundClient

SPEC = cli.dense_spec(6, epsilon=1.0, gamma=0.01)
KEY = sybil.budget_key("127.0.0.1", False)


def _service(writes, **kw):
  """A service whose store.replace follows `writes`, one entry per call: "times_out" (nothing
  lands, StoreUnavailable), "lands_then_times_out" (the write lands, then StoreUnavailable),
  "refused" (StoreRefused, nothing lands) or "ok"; calls past the list are "ok". Records each
  call's nonce."""
  kw.setdefault("influence_steps", None)
  kw.setdefault("influence_half_life_s", None)  # no decay: the budget's sums are exact
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0, **kw)
  real, calls = svc.store.replace, []

  async def replace(i, w, nonce=None, *a, **kw):
    mode = writes[len(calls)] if len(calls) < len(writes) else "ok"
    calls.append(nonce)
    if mode == "times_out":
      raise store_lib.StoreUnavailable("redis: TimeoutError (simulated, nothing written)")
    if mode == "refused":
      raise store_lib.StoreRefused("redis: OOM (simulated, nothing written)")
    seq = await real(i, w, nonce, *a, **kw)
    if mode == "lands_then_times_out":
      raise store_lib.StoreUnavailable("redis: TimeoutError (simulated, after the write)")
    return seq

  svc.store.replace = replace
  return svc, calls


def _drawn_update(c, seed):
  rng = np.random.default_rng(seed)
  d = c.draw()
  return d, client.spec_update(d.spec, d.weights, {"x": rng.random((8, 5))}, np.zeros(8), rng=rng)


def _assert_charged_once(svc, step):
  n, c = svc.budget.state(KEY)
  assert n == 1, f"budget counts {n} steps for 1 stored update"
  np.testing.assert_allclose(c, step, rtol=1e-12, atol=0)


@pytest.mark.parametrize("writes,answer", [
    (["times_out"], {"accepted": True, "seq": 1}),
    (["times_out", "times_out"], {"accepted": True, "seq": 1}),
    (["times_out", "refused"], {"accepted": True, "seq": 1}),
    (["lands_then_times_out"], {"accepted": True, "seq": None, "resent": True}),
], ids=["not_landed", "not_landed_twice", "not_landed_then_refused", "landed"])
def test_a_resent_submit_is_stored_once_and_charged_once(start_service, writes, answer):
  svc, calls = _service(writes)
  s = start_service(svc)
  with BoundClient(s.url, "127.0.0.1") as c:
    d, u = _drawn_update(c, 3)
    assert c.submit(d, u) == answer
  assert len(calls) == len(writes) + 1 and len(set(calls)) == 1  # resent with the same ticket
  assert s.call(svc.store.counters())["seq"] == 1
  _assert_charged_once(svc, u - d.weights)


def test_a_resend_refused_before_writing_keeps_the_first_charge(start_service):
  """The first send's outcome is unknown, the resend is refused by the store before writing
  (it says nothing about the first send): the first charge stays (conservative), once."""
  svc, _ = _service(["times_out", "refused"])
  s = start_service(svc)
  with BoundClient(s.url, "127.0.0.1", max_resends=1) as c:
    d, u = _drawn_update(c, 4)
    with pytest.raises(client_lib.SubmitOutcomeUnknown):
      c.submit(d, u)
  assert s.call(svc.store.counters())["seq"] == 0
  _assert_charged_once(svc, u - d.weights)


def test_another_update_under_the_same_ticket_is_charged_for_its_own_step(start_service):
  """After an unknown outcome, a 'resend' with other weights under the same ticket is not the
  same submission: it is charged in full (both steps stay: the budget never counts less than
  what may be stored)."""
  svc, _ = _service(["times_out"])
  s = start_service(svc)
  with BoundClient(s.url, "127.0.0.1") as c:
    d, u = _drawn_update(c, 5)
  body, headers = client_wire.submit_request(d, u)
  status, _, data = http_request(s.port, "POST", "/v1/submit", body, headers)
  assert status == 503 and json.loads(data)["error"] == "outcome_unknown"
  u2 = u + 1e-3
  body2, _ = client_wire.submit_request(d, u2)
  status, _, data = http_request(s.port, "POST", "/v1/submit", body2, headers)
  assert status == 200, data
  n, c = svc.budget.state(KEY)
  assert n == 2
  np.testing.assert_allclose(c, (u - d.weights) + (u2 - d.weights), rtol=1e-12)
  # the first submission sent again now: its ticket is used, nothing stored, no new charge
  status, _, data = http_request(s.port, "POST", "/v1/submit", body, headers)
  assert status == 409 and json.loads(data)["error"] == "ticket_used"
  assert svc.budget.state(KEY)[0] == 2 and s.call(svc.store.counters())["seq"] == 1


def test_an_unsettled_charge_is_kept_bounded_and_while_its_ticket_lives():
  """The record that lets a resend take over a charge lives as long as the ticket may be
  resent, and the records are bounded (the oldest go first). A resend whose record went is
  charged again: more, never less."""
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0, influence_steps=None)
  adm, p = svc.admission, SPEC.num_weights
  for i in range(adm.max_unsettled + 5):
    adm.keep_unsettled(admission.Admitted(f"id{i}", np.full(p, float(i)), f"{i:024x}"), 60.0)
  assert adm.unsettled_count() == adm.max_unsettled
  assert adm.take_unsettled(f"{0:024x}", "id0", np.zeros(p)) is None  # the oldest went
  last = adm.max_unsettled + 4
  assert adm.take_unsettled(f"{last:024x}", "id0", np.full(p, float(last))) is None  # not its key
  adm.keep_unsettled(admission.Admitted("late", np.zeros(p), "f" * 24), 1e-3)
  time.sleep(0.01)
  assert adm.take_unsettled("f" * 24, "late", np.zeros(p)) is None  # its ticket expired
  adm.keep_unsettled(admission.Admitted("kept", np.ones(p), "e" * 24), 60.0)
  assert adm.take_unsettled("e" * 24, "kept", np.ones(p) * 2) is None  # another step
  adm.keep_unsettled(admission.Admitted("kept", np.ones(p), "d" * 24), 60.0)
  got = adm.take_unsettled("d" * 24, "kept", np.ones(p))
  assert got is not None and got.identity == "kept" and got.resent
  assert adm.take_unsettled("d" * 24, "kept", np.ones(p)) is None  # taken once


# ---- 2. no resend without a ticket the server checks ----------------------------------------

def _dropping(svc):
  """svc whose first submit is stored, then its connection aborted (the answer is lost)."""
  original, sends = svc.handle_submit, []

  async def drop_first_answer(request):
    sends.append(1)
    resp = await original(request)
    if len(sends) == 1:
      request.transport.abort()
    return resp

  svc.handle_submit = drop_first_answer
  return sends


@pytest.mark.parametrize("with_drawn", [True, False], ids=["drawn", "version"])
def test_without_tickets_a_dropped_submit_is_not_resent(start_service, with_drawn):
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0, tickets=False)
  sends = _dropping(svc)
  s = start_service(svc)
  with BoundClient(s.url, "127.0.0.1") as c:
    d, u = _drawn_update(c, 6)
    with pytest.raises(client_lib.SubmitOutcomeUnknown, match="may be stored") as e:
      c.submit(d if with_drawn else d.version, u)
  assert e.value.attempts == 1 and e.value.code == "outcome_unknown"
  assert len(sends) == 1 and s.call(svc.store.counters())["seq"] == 1
  assert d.ticket and not d.resend_safe  # a ticket the server does not check


def test_without_tickets_the_async_client_does_not_resend_a_dropped_submit(start_service):
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0, tickets=False)
  sends = _dropping(svc)
  s = start_service(svc)
  rng = np.random.default_rng(7)

  async def go():
    ac = client_lib.AsyncDDMLClient(s.url)
    try:
      return await ac.update({"x": rng.random((8, 5))}, np.zeros(8), rng=rng)
    finally:
      await ac.close()

  with pytest.raises(client_lib.SubmitOutcomeUnknown, match="may be stored"):
    asyncio.run(go())
  assert len(sends) == 1 and s.call(svc.store.counters())["seq"] == 1


def test_with_tickets_a_dropped_submit_is_still_resent_and_stored_once(start_service):
  """Unchanged with tickets: the draw says the server checks them, the client resends once
  after a dropped connection and the 409 ticket_used is 'stored once' (sync and async)."""
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0, influence_steps=None)
  sends = _dropping(svc)
  s = start_service(svc)
  rng = np.random.default_rng(8)

  async def go():
    ac = client_lib.AsyncDDMLClient(s.url)
    try:
      d = await ac.draw()
      u = client.spec_update(d.spec, d.weights, {"x": rng.random((8, 5))}, np.zeros(8), rng=rng)
      return await ac.submit(d, u), d
    finally:
      await ac.close()

  answer, d = asyncio.run(go())
  assert answer == {"accepted": True, "seq": None, "resent": True}
  assert len(sends) == 2 and s.call(svc.store.counters())["seq"] == 1
  with BoundClient(s.url, "127.0.0.1") as c:
    d2, u = _drawn_update(c, 9)
    answer, d3 = c.submit_and_draw(d2, u)
  assert answer == {"accepted": True, "seq": 2}
  assert d.resend_safe and d2.resend_safe and d3.resend_safe  # the draws said: tickets checked


def test_without_tickets_a_keep_alive_closed_by_the_server_is_not_an_unknown_outcome(
    start_service):
  """The server closed the idle keep-alive connection before the submit: the client sees it
  and sends on a new connection (nothing was sent on the old one), so no resend is needed."""
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0, tickets=False)
  original = svc.handle_draw

  async def draw_then_close_idle(request):
    resp = await original(request)
    asyncio.get_running_loop().call_later(0.05, request.transport.close)
    return resp

  svc.handle_draw = draw_then_close_idle
  s = start_service(svc)
  with BoundClient(s.url, "127.0.0.1") as c:
    d, u = _drawn_update(c, 10)  # the spec is fetched: the next draw is the last request
    c.draw()
    time.sleep(0.3)  # the server closes the idle connection
    assert c._conn is not None and c._conn.sock is not None  # the client has not noticed
    assert c.submit(d, u) == {"accepted": True, "seq": 1}  # (a version string: a spec GET first)
  assert s.call(svc.store.counters())["seq"] == 1
