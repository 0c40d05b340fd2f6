"""A submit whose store write has an unknown outcome (the store took the write, then its answer
timed out) is resent by the client with the same ticket, never with new data.

Before: the server answered 503 store_unavailable ("retry") and the client raised it, so a
caller retrying `update()` drew again and trained a second noisy update on the same records
(a second local-DP release of the data, and the update counted twice in the model). Now the
server answers 503 outcome_unknown; the client resends the same submission with the same
ticket (bounded), takes a 409 ticket_used on that resend as "stored once", and when it gives
up raises SubmitOutcomeUnknown (the update may be stored: do not send it again)."""

import asyncio
import json

import numpy as np
import pytest

from tf_dpiter.draw_discard import cli, client, client_lib, client_wire, service
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.errors import ParameterValueError
from tests.draw_discard.conftest import http_request
from tests.draw_discard.loopback import BoundClient

SPEC = cli.dense_spec(6, epsilon=1.0, gamma=0.01)
TIMEOUT = "redis: TimeoutError (simulated, after the write was sent)"


def _service(writes, **kw):
  """A service whose store.replace follows `writes`, one entry per call: "lands_then_times_out"
  (the write lands, then StoreUnavailable), "lands_then_faults" (the write lands, then a
  RuntimeError), "times_out" (nothing lands, StoreUnavailable), or "ok"; calls past the list are "ok". Records each call's nonce and counts the draws."""
  kw.setdefault("influence_steps", None)
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0, **kw)
  real, calls, draws = svc.store.replace, [], []

  async def replace(i, w, nonce=None, *a, **kw):
    mode = writes[len(calls)] if len(calls) < len(writes) else "ok"
    calls.append(nonce)
    if mode == "times_out":
      raise store_lib.StoreUnavailable(TIMEOUT)
    seq = await real(i, w, nonce, *a, **kw)
    if mode == "lands_then_times_out":
      raise store_lib.StoreUnavailable(TIMEOUT)
    if mode == "lands_then_faults":   # a fault that is not the store's, after the write
      raise RuntimeError("simulated fault after the write")
    return seq

  svc.store.replace = replace
  original_draw = svc.handle_draw

  async def counted_draw(request):
    draws.append(1)
    return await original_draw(request)

  svc.handle_draw = counted_draw
  return svc, calls, draws


def _assert_stored_once(s, svc, calls, draws):
  """One update stored, by two sends of the same ticket, from one draw."""
  counters = s.call(svc.store.counters())
  assert counters["seq"] == 1 and counters["accepted"] == 1
  assert len(calls) == 2 and calls[0] == calls[1] and len(draws) == 1


def _records(rng):
  return {"x": rng.random((8, 5))}, np.zeros(8)


def test_update_after_a_write_that_landed_then_timed_out_is_stored_once(start_service):
  svc, calls, draws = _service(["lands_then_times_out"])
  s = start_service(svc)
  rng = np.random.default_rng(3)
  with BoundClient(s.url, "127.0.0.1") as c:
    answer = c.update(*_records(rng), rng=rng)
    assert answer == {"accepted": True, "seq": None, "resent": True}
    counters = s.call(svc.store.counters())
    assert counters["seq"] == 1 and counters["accepted"] == 1
    assert len(calls) == 2 and calls[0] == calls[1]  # resent with the same ticket
    assert len(draws) == 1  # never drawn (and trained) again
    # the next round is a normal one
    assert c.update(*_records(rng), rng=rng) == {"accepted": True, "seq": 2}


def test_update_after_a_write_that_did_not_land_is_stored_by_the_resend(start_service):
  svc, calls, draws = _service(["times_out"])
  s = start_service(svc)
  rng = np.random.default_rng(4)
  with BoundClient(s.url, "127.0.0.1") as c:
    assert c.update(*_records(rng), rng=rng) == {"accepted": True, "seq": 1}
  _assert_stored_once(s, svc, calls, draws)


def test_the_server_answers_outcome_unknown_for_a_write_that_may_have_landed(start_service):
  svc, _, _ = _service(["lands_then_times_out"])
  s = start_service(svc)
  rng = np.random.default_rng(5)
  with BoundClient(s.url, "127.0.0.1") as c:
    d = c.draw()
    u = client.spec_update(d.spec, d.weights, *_records(rng), rng=rng)
    body, headers = client_wire.submit_request(d, u)
  status, hdrs, data = http_request(s.port, "POST", "/v1/submit", body, headers)
  answer = json.loads(data)
  assert status == 503 and answer["error"] == "outcome_unknown" and hdrs["Retry-After"]
  assert answer["resend"] == "same_ticket"
  assert "same ticket" in answer["message"]
  # the same submission again: its ticket is used, the store holds it once
  status, _, data = http_request(s.port, "POST", "/v1/submit", body, headers)
  assert status == 409 and json.loads(data)["error"] == "ticket_used"
  assert s.call(svc.store.counters())["seq"] == 1


def test_a_client_that_gives_up_says_the_update_may_be_stored(start_service):
  svc, calls, draws = _service(["lands_then_times_out", "times_out", "times_out"])
  s = start_service(svc)
  rng = np.random.default_rng(6)
  with BoundClient(s.url, "127.0.0.1", max_resends=1) as c:
    with pytest.raises(client_lib.SubmitOutcomeUnknown, match="may be stored") as e:
      c.update(*_records(rng), rng=rng)
  assert isinstance(e.value, client_lib.DDMLError) and e.value.code == "outcome_unknown"
  assert len(calls) == 2 and calls[0] == calls[1] and len(draws) == 1
  assert s.call(svc.store.counters())["seq"] == 1


def test_max_resends_is_checked():
  with pytest.raises(ParameterValueError, match=r"Received: max_resends=-1"):
    client_lib.DDMLClient("http://127.0.0.1:9", max_resends=-1)
  with pytest.raises(ParameterValueError, match=r"Received: max_resends=-1"):
    client_lib.AsyncDDMLClient("http://127.0.0.1:9", max_resends=-1)


def test_async_update_after_a_write_that_landed_then_timed_out_is_stored_once(start_service):
  svc, calls, draws = _service(["lands_then_times_out"])
  s = start_service(svc)
  rng = np.random.default_rng(7)

  async def go():
    ac = client_lib.AsyncDDMLClient(s.url)
    try:
      return await ac.update(*_records(rng), rng=rng)
    finally:
      await ac.close()

  assert asyncio.run(go()) == {"accepted": True, "seq": None, "resent": True}
  _assert_stored_once(s, svc, calls, draws)


def test_submit_and_draw_after_a_write_that_landed_then_timed_out_is_stored_once(start_service):
  svc, calls, _ = _service(["lands_then_times_out"])
  s = start_service(svc)
  rng = np.random.default_rng(8)
  with BoundClient(s.url, "127.0.0.1") as c:
    d = c.draw()
    u = client.spec_update(d.spec, d.weights, *_records(rng), rng=rng)
    answer, nxt = c.submit_and_draw(d, u)
  assert answer == {"accepted": True, "seq": None, "resent": True} and nxt is None
  assert s.call(svc.store.counters())["seq"] == 1 and len(calls) == 2


def test_without_tickets_an_unknown_outcome_is_raised_and_not_resent(start_service):
  """Without tickets nothing dedupes a resend: the server says so ("resend": "never") and the
  client raises SubmitOutcomeUnknown without resending."""
  svc, calls, _ = _service(["lands_then_times_out"], tickets=False)
  s = start_service(svc)
  rng = np.random.default_rng(10)
  with BoundClient(s.url, "127.0.0.1") as c:
    d = c.draw()
    assert d.ticket  # issued also without tickets, which the server then does not check
    u = client.spec_update(d.spec, d.weights, *_records(rng), rng=rng)
    with pytest.raises(client_lib.SubmitOutcomeUnknown, match="may be stored"):
      c.submit(d, u)
  assert len(calls) == 1 and s.call(svc.store.counters())["seq"] == 1


def test_a_submit_whose_answer_times_out_is_reported_as_maybe_stored(start_service):
  """The server stores the update and answers after the client's timeout: the client does
  not know that the server dedupes by ticket, so it does not resend, and raises
  SubmitOutcomeUnknown (before: a bare TimeoutError, which a caller would retry with a new
  draw and a second update of the same records)."""
  svc, calls, draws = _service([])
  original, slow = svc.handle_submit, []

  async def stored_then_slow(request):
    resp = await original(request)
    if not slow:
      slow.append(1)
      await asyncio.sleep(2.0)
    return resp

  svc.handle_submit = stored_then_slow
  s = start_service(svc)
  rng = np.random.default_rng(11)
  with BoundClient(s.url, "127.0.0.1", timeout=0.5) as c:
    with pytest.raises(client_lib.SubmitOutcomeUnknown, match="may be stored"):
      c.update(*_records(rng), rng=rng)
  assert len(calls) == 1 and len(draws) == 1
  assert s.call(svc.store.counters())["seq"] == 1


def test_update_after_a_write_that_landed_then_another_fault_is_stored_once(start_service):
  """Any fault after the write was sent, not only the store's: the outcome is unknown too.
  Before, a RuntimeError there was 500 internal_error, which the client does not resend: a
  caller retrying update() drew and sent the same records again (stored twice)."""
  svc, calls, draws = _service(["lands_then_faults"])
  s = start_service(svc)
  rng = np.random.default_rng(9)
  with BoundClient(s.url, "127.0.0.1") as c:
    assert c.update(*_records(rng), rng=rng) == {"accepted": True, "seq": None, "resent": True}
  _assert_stored_once(s, svc, calls, draws)
