"""GET /v1/model under the draws' privacy rule: batched releases, charged to the draw quota."""

import uuid

import numpy as np
import pytest

from tf_dpiter.draw_discard import auth, cli, client_lib, service
from tf_dpiter.draw_discard import parsing, store as store_lib
from tf_dpiter.draw_discard import store_factory

from tests.draw_discard.conftest import honest

SPEC = cli.dense_spec(17, epsilon=1.0, gamma=0.01)
K = 6
VICTIM, ATTACKER = "victim-token-0123456789abcdef", "attacker-token-0123456789abc"


def _svc(store=None, **kw):
  return service.DDMLService(SPEC, K, store or store_lib.MemoryStore(), seed=0,
                             tokens=auth.TokenSet([VICTIM, ATTACKER]),
                             secret=b"model-release-test-secret-0123456789",
                             influence_steps=None, **kw)


def _differencing_attack(srv, n=20):
  """Victim steps the attacker recovers from model reads around each victim update.

  The attacker is granted every instance before the update (more than draws give it): it
  recovers the stored update when k (m1 - m0) + x_r equals it for some slot r.
  """
  rng = np.random.default_rng(1)
  recovered = 0
  with client_lib.DDMLClient(srv.url, token=VICTIM, insecure=True) as v, \
       client_lib.DDMLClient(srv.url, token=ATTACKER, insecure=True) as a:
    for _ in range(n):
      before = srv.call(srv.svc.store.snapshot()).slots.copy()
      m0 = a.model()
      d = v.draw()
      v.submit(d, honest(SPEC, d.weights, rng))
      m1 = a.model()
      after = srv.call(srv.svc.store.snapshot()).slots
      new = [row for row in after if not any(np.array_equal(row, b) for b in before)]
      guesses = K * (m1 - m0) + before
      recovered += any(np.allclose(g, new[0], rtol=0, atol=1e-9) for g in guesses)
  return recovered


def test_differencing_model_reads_no_longer_recovers_victim_updates(start_service):
  per_update = start_service(_svc(model_min_updates=1, model_interval_s=0.0))
  assert _differencing_attack(per_update) == 20  # what /v1/model allowed before (control)
  batched = start_service(_svc())  # defaults: >= k updates and >= 10 s between releases
  assert _differencing_attack(batched) == 0


def test_release_needs_min_updates_and_carries_its_seq(start_service):
  srv = start_service(_svc(model_min_updates=3, model_interval_s=0.0))
  rng = np.random.default_rng(2)
  with client_lib.DDMLClient(srv.url, token=VICTIM, insecure=True) as c:
    m0 = c.model()
    seqs = []
    for _ in range(7):
      d = c.draw()
      c.submit(d, honest(SPEC, d.weights, rng))
      c.model()
      seqs.append(c.last_model_seq)
  assert seqs == [0, 0, 3, 3, 3, 6, 6]
  snap = srv.call(srv.svc.store.snapshot())
  assert not np.array_equal(m0, snap.slots.mean(axis=0))


def test_model_reads_are_charged_to_the_draw_quota(start_service):
  now = [0.0]
  quotas = auth.Quotas({"draw": 1.0}, {"draw": 2}, clock=lambda: now[0])
  srv = start_service(_svc(quotas=quotas))
  with client_lib.DDMLClient(srv.url, token=ATTACKER, insecure=True) as c:
    c.model()
    c.model()
    with pytest.raises(client_lib.DDMLError) as e:
      c.model()
    assert e.value.status == 429
    with pytest.raises(client_lib.DDMLError) as e:
      c.draw()  # one bucket for draws and model reads
    assert e.value.status == 429


def test_two_redis_servers_share_one_release(start_service, redis_url):
  prefix = f"t{uuid.uuid4().hex[:8]}"
  srvs = [start_service(_svc(store_factory.make_store(redis_url, prefix), model_min_updates=2,
                             model_interval_s=0.0)) for _ in range(2)]
  rng = np.random.default_rng(3)
  a = client_lib.DDMLClient(srvs[0].url, token=VICTIM, insecure=True)
  b = client_lib.DDMLClient(srvs[1].url, token=ATTACKER, insecure=True)
  a.model()
  for i in range(5):
    d = a.draw()
    a.submit(d, honest(SPEC, d.weights, rng))
    ma, mb = a.model(), b.model()  # never two releases closer than 2 updates
    assert a.last_model_seq == b.last_model_seq and np.array_equal(ma, mb)
    assert a.last_model_seq in (0, 2, 4)
  a.close()
  b.close()


def test_stale_release_reader_gets_the_current_release_not_a_rollback(redis_url):
  """A reader whose snapshot is older than a release another server
  made meanwhile gets that release; only the store's own sequence number going back is a
  rollback."""
  import asyncio
  import redis
  prefix = f"t{uuid.uuid4().hex[:8]}"
  rng = np.random.default_rng(5)

  async def run():
    a, b = (_svc(store_factory.make_store(redis_url, prefix), model_min_updates=2,
                 model_interval_s=0.0) for _ in range(2))
    await a.startup()
    await b.startup()
    try:
      stale = await b.snapshots.refresh(await b.store.touch())  # b's snapshot at seq 0
      first = await b.release.current()  # the release at seq 0
      for _ in range(2):
        h, ticket = await a.draw_for(VICTIM)
        await a.store_ticketed(VICTIM, parsing.Submission(honest(SPEC, h, rng), h, ticket))
      newer = await a.release.current()  # a releases the average at seq 2
      assert (first.seq, newer.seq) == (0, 2)
      # b sets with its older snapshot (seq 0 < 2), as ModelRelease.current does in the race
      got, due = await b.store.release(stale.seq + 1, stale.slots.mean(axis=0), K, 1, 0.0)
      assert got.seq == 2 and np.array_equal(got.mean, newer.mean) and not due
      assert (await b.release.current()).seq == 2  # b keeps serving: nothing sticky
      assert await b.store.touch() == 2
      r = redis.Redis.from_url(redis_url)
      r.set(f"{prefix}:seq", 1)  # the store's own number goes back: that is a rollback
      r.close()
      with pytest.raises(store_lib.StoreRolledBack):
        await b.store.release(1, None, K, 2, 0.0)
    finally:
      await a.shutdown()
      await b.shutdown()

  asyncio.run(run())


def test_reset_drops_the_old_models_release(redis_url):
  """--reset re-creates the model at sequence number 0; the old model's release (at seq 3)
  must go with it. Before: it stayed, the first /v1/model read took it for a rollback
  (3 > 0), and StoreRolledBack stuck: every request of the new model answered 503, also
  after a restart."""
  import asyncio
  prefix = f"t{uuid.uuid4().hex[:8]}"
  rng = np.random.default_rng(6)

  async def run():
    old = _svc(store_factory.make_store(redis_url, prefix), model_min_updates=1,
               model_interval_s=0.0)
    await old.startup()
    try:
      for _ in range(3):
        h, ticket = await old.draw_for(VICTIM)
        await old.store_ticketed(VICTIM, parsing.Submission(honest(SPEC, h, rng), h, ticket))
      assert (await old.release.current()).seq == 3
    finally:
      await old.shutdown()
    new = _svc(store_factory.make_store(redis_url, prefix), model_min_updates=1,
               model_interval_s=0.0, reset=True)
    await new.startup()
    try:
      rel = await new.release.current()
      assert rel.seq == 0
      snap = await new.store.snapshot()
      np.testing.assert_allclose(rel.mean, snap.slots.mean(axis=0))
      assert await new.store.touch() == 0  # nothing sticky
    finally:
      await new.shutdown()

  asyncio.run(run())
