"""Store integrity: rollback, deleted/corrupted/swapped slots, the join check and the secret.

Loopback only; each test uses its own Redis key prefix (or its own redis-server).
"""

import asyncio
import json
import urllib.parse
import uuid

import numpy as np
import pytest

from tf_dpiter.draw_discard import auth, cli, client_lib, keys, service
from tf_dpiter.draw_discard import parsing, store as store_lib
from tf_dpiter.draw_discard import store_factory

from tests.draw_discard.conftest import honest, http_request, start_redis

SPEC = cli.dense_spec(33, epsilon=1.0, gamma=0.01)
SECRET = bytes(range(32))


def get(port, path):
  status, _, data = http_request(port, "GET", path)
  return status, data


def _svc(url, prefix=None, **kw):
  store = store_factory.make_store(url, prefix or f"t{uuid.uuid4().hex[:8]}")
  return service.DDMLService(SPEC, 5, store, seed=0, secret=SECRET, **kw)


def _submit_code(c, drawn, w):
  try:
    c.submit(drawn, w)
    return 200, "accepted"
  except client_lib.DDMLError as e:
    return e.status, e.code


def test_redis_rollback_is_detected_and_used_ticket_not_reaccepted(start_service, own_redis,
                                                                   tmp_path):
  import redis
  url, proc = own_redis
  port = urllib.parse.urlparse(url).port
  srv = start_service(_svc(url))
  rng = np.random.default_rng(0)
  r = redis.Redis.from_url(url)
  with client_lib.DDMLClient(srv.url) as c:
    for _ in range(2):
      d = c.draw()
      c.submit(d, honest(SPEC, d.weights, rng))
    r.save()  # the older snapshot Redis will come back from
    seq_saved = c.metrics()["seq"]
    drawn = c.draw()
    used = honest(SPEC, drawn.weights, rng)
    assert c.submit(drawn, used)["seq"] == seq_saved + 1
    for _ in range(2):
      d = c.draw()
      c.submit(d, honest(SPEC, d.weights, rng))
    r.close()
    proc.terminate()
    proc.wait(10)
    again = start_redis(port, tmp_path)  # loads dump.rdb: the rollback
    try:
      for _ in range(100):  # the pool reconnects after one store_unavailable
        status, code = _submit_code(c, drawn, used)
        if code != "store_unavailable":
          break
      assert (status, code) == (503, "store_lost")  # not 200: the used ticket is refused
      st, body = get(srv.port, "/healthz")
      assert st == 503 and json.loads(body)["error"] == "store_lost"
      assert get(srv.port, "/v1/model")[0] == 503  # sticky: nothing read from the old store
    finally:
      again.terminate()
      again.wait(10)


@pytest.mark.parametrize("fault", ["short", "deleted", "bit_flip", "swapped", "plain_bytes"])
def test_bad_slot_fails_health_and_reads(start_service, redis_url, fault):
  import redis
  svc = _svc(redis_url)
  srv = start_service(svc)
  r = redis.Redis.from_url(redis_url)
  key = f"{svc.store.prefix}:slot:1"
  raw = r.get(key)
  if fault == "short":
    r.set(key, raw[:-8])
  elif fault == "deleted":
    r.delete(key)
  elif fault == "bit_flip":
    r.set(key, bytes([raw[0] ^ 1]) + raw[1:])
  elif fault == "swapped":
    r.set(key, r.get(f"{svc.store.prefix}:slot:2"))
  else:  # right length, no valid tag (what a writer without the secret can produce)
    r.set(key, store_lib.encode_weights(np.zeros(SPEC.num_weights)) + b"\0" * 28)
  r.close()
  st, body = get(srv.port, "/healthz")
  assert st == 503 and json.loads(body)["error"] == "store_lost", body
  assert get(srv.port, "/v1/model")[0] == 503


@pytest.mark.parametrize("change", [
    dict(alpha=1e-300), dict(budget_alpha=1e-300), dict(tickets=False, history=0),
    dict(ticket_ttl_s=600.0), dict(rebase=False), dict(max_abs_weight=1e9),
    dict(quotas=auth.Quotas({"draw": 100.0})), dict(tokens=auth.TokenSet(["t" * 16])),
    dict(influence_steps=None), dict(influence_half_life_s=60.0), dict(model_interval_s=0.0),
    dict(model_min_updates=1)])
def test_join_check_covers_every_setting(redis_url, change):
  prefix = f"t{uuid.uuid4().hex[:8]}"

  async def go():
    a, same = _svc(redis_url, prefix), _svc(redis_url, prefix)
    b = _svc(redis_url, prefix, **change)
    try:
      await a.startup()
      await same.startup()  # identical settings and secret: joins
      with pytest.raises(store_lib.StoreMismatch, match="setting"):
        await b.startup()
    finally:
      for s in (a, same, b):
        await s.shutdown()

  asyncio.run(go())


def test_join_needs_the_same_secret_and_store_holds_no_key(redis_url):
  import redis
  prefix = f"t{uuid.uuid4().hex[:8]}"

  async def go():
    a = _svc(redis_url, prefix)
    b = service.DDMLService(SPEC, 5, store_factory.make_store(redis_url, prefix), seed=0,
                            secret=bytes(32))
    try:
      await a.startup()
      with pytest.raises(store_lib.StoreMismatch, match="secret"):
        await b.startup()
    finally:
      await a.shutdown()
      await b.shutdown()

  asyncio.run(go())
  r = redis.Redis.from_url(redis_url)
  dump = b"".join(r.get(k) or b"" for k in r.keys(f"{prefix}:*") if r.type(k) == b"string")
  r.close()
  for secret_key in (SECRET, keys.derive(SECRET, "tickets"), keys.derive(SECRET, "slots")):
    assert secret_key not in dump and secret_key.hex().encode() not in dump


def test_secret_from_file_and_env(tmp_path):
  f = tmp_path / "key"
  f.write_text(SECRET.hex() + "\n")
  assert keys.load_secret(str(f)) == SECRET
  assert keys.load_secret(None, {"DDML_SECRET": SECRET.hex()}) == SECRET
  assert keys.load_secret(None, {}) is None
  with pytest.raises(ValueError, match="32 bytes"):
    keys.load_secret(None, {"DDML_SECRET": "abcd"})


def test_anchor_file_detects_a_rollback_made_while_the_server_was_down(own_redis, tmp_path):
  import redis
  url, proc = own_redis
  port = urllib.parse.urlparse(url).port
  prefix, anchor = f"t{uuid.uuid4().hex[:8]}", str(tmp_path / "anchor.json")
  rng = np.random.default_rng(4)

  async def run_updates(n, state_file=anchor):
    svc = _svc(url, prefix, state_file=state_file)
    await svc.startup()
    try:
      for _ in range(n):
        h, ticket = await svc.draw_for("me")
        await svc.store_ticketed("me", parsing.Submission(honest(SPEC, h, rng), h, ticket))
    finally:
      await svc.shutdown()  # writes the anchor

  asyncio.run(run_updates(2))
  r = redis.Redis.from_url(url)
  r.save()
  r.close()
  asyncio.run(run_updates(3))  # seq 5 anchored
  proc.terminate()
  proc.wait(10)
  again = start_redis(port, tmp_path)  # back at seq 2
  try:
    with pytest.raises(store_lib.StoreRolledBack, match="rolled back while it was down"):
      asyncio.run(run_updates(0))
    asyncio.run(run_updates(0, None))  # without the anchor it cannot tell (documented)
  finally:
    again.terminate()
    again.wait(10)


@pytest.mark.parametrize("reread", [False, True])  # True: the rebase re-reads the snapshot
@pytest.mark.parametrize("key", ["hist", "counters", "seq"])
def test_a_key_of_another_type_fails_the_replace_before_any_write(redis_url, key, reread):
  """Redis keeps a script's writes when a later command of it fails. A key of the model
  overwritten with another type (a Redis writer without the secret) made REPLACE fail after
  it had stored the slot and the nonce but before the sequence number moved (a silent change
  at an unchanged seq; the client got a 500). Now REPLACE checks the types first: StoreCorrupt
  (503 store_lost), nothing written."""
  import asyncio
  import redis
  import uuid
  from tf_dpiter.draw_discard import cli, parsing, service, store_factory
  from tests.draw_discard.conftest import honest
  spec = cli.dense_spec(9, epsilon=1.0, gamma=0.01)
  prefix = f"t{uuid.uuid4().hex[:8]}"
  rng = np.random.default_rng(2)

  async def run():
    svc = service.DDMLService(spec, 4, store_factory.make_store(redis_url, prefix), seed=0,
                              secret=bytes(range(32)), influence_steps=None, history=4)
    await svc.startup()
    try:
      h, ticket = await svc.draw_for("me")
      await svc.store_ticketed("me", parsing.Submission(honest(spec, h, rng), h, ticket))
      h, ticket = await svc.draw_for("me")  # the draw before the damage (it counts draws)
      svc.snapshots.max_age_s = 0.0 if reread else 1e9
      r = redis.Redis.from_url(redis_url)
      slots_before = [r.get(f"{prefix}:slot:{i}") for i in range(4)]
      if key == "seq":
        r.set(f"{prefix}:seq", "1.5")   # a number, not an integer: INCR would fail
      else:
        r.delete(f"{prefix}:{key}")
        r.set(f"{prefix}:{key}", "x")   # a string where a list / hash belongs
      with pytest.raises(store_lib.StoreCorrupt, match="another type"):
        await svc.store_ticketed("me", parsing.Submission(honest(spec, h, rng), h, ticket))
      assert [r.get(f"{prefix}:slot:{i}") for i in range(4)] == slots_before
      assert len(r.keys(f"{prefix}:nonce:*")) == 1  # the first submit's only
      r.close()
    finally:
      await svc.shutdown()

  asyncio.run(run())


def test_a_wrong_type_reply_on_draw_is_store_corrupt_not_a_500(redis_url):
  """TOUCH counts draws in the counters hash; a string there made redis-py raise
  ResponseError WRONGTYPE, a 500 internal_error. Now StoreCorrupt (503 store_lost)."""
  import redis
  from tf_dpiter.draw_discard import cli, service, store_factory
  spec = cli.dense_spec(9, epsilon=1.0, gamma=0.01)
  prefix = f"t{uuid.uuid4().hex[:8]}"

  async def run():
    svc = service.DDMLService(spec, 4, store_factory.make_store(redis_url, prefix), seed=0,
                              secret=bytes(range(32)), influence_steps=None)
    await svc.startup()
    try:
      await svc.draw_for("me")
      r = redis.Redis.from_url(redis_url)
      r.delete(f"{prefix}:counters")
      r.set(f"{prefix}:counters", "x")
      r.close()
      with pytest.raises(store_lib.StoreCorrupt, match="another type"):
        await svc.draw_for("me")
    finally:
      await svc.shutdown()

  asyncio.run(run())
