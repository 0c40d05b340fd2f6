"""A submit whose answer is lost (the server stored the update, then the connection dropped:
a restart, a proxy timeout) is resent once by DDMLClient; the resend finds the ticket used.
Before: the client raised DDMLError 409 ticket_used, so a caller retrying `update` trained a
second noisy update on the same records (the record's epsilon spent twice, the data applied
twice). Now the resend is reported as stored; the store holds the update once."""

import numpy as np

from tf_dpiter.draw_discard import cli, client, service
from tf_dpiter.draw_discard import store as store_lib
from tests.draw_discard.loopback import BoundClient

SPEC = cli.dense_spec(6, epsilon=1.0, gamma=0.01)


def test_a_lost_submit_answer_is_not_an_error_and_stores_once(start_service):
  svc = service.DDMLService(SPEC, 4, store_lib.MemoryStore(), seed=0, influence_steps=None)
  original, drops = svc.handle_submit, []

  async def drop_first_answer(request):
    resp = await original(request)
    if not drops:  # stored; the answer never reaches the client
      drops.append(1)
      request.transport.abort()
    return resp

  svc.handle_submit = drop_first_answer
  s = start_service(svc)
  rng = np.random.default_rng(3)
  c = BoundClient(s.url, "127.0.0.1")
  d = c.draw()
  u = client.spec_update(d.spec, d.weights, {"x": rng.random((8, 5))}, np.zeros(8), rng=rng)
  answer = c.submit(d, u)
  assert drops == [1]
  assert answer == {"accepted": True, "seq": None, "resent": True}
  counters = s.call(svc.store.counters())
  assert counters["seq"] == 1 and counters["accepted"] == 1
  # the next, normal submit is acknowledged with its sequence number
  d = c.draw()
  u = client.spec_update(d.spec, d.weights, {"x": rng.random((8, 5))}, np.zeros(8), rng=rng)
  assert c.submit(d, u) == {"accepted": True, "seq": 2}
  c.close()
