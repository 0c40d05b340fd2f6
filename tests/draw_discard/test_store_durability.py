"""A Redis store cannot lose acknowledged updates silently.

Each test runs its own redis-server on 127.0.0.1 (no persistence; SAVE writes the RDB
snapshot a restart comes back to) and in-process servers (DDMLService.startup/shutdown).
"""

import asyncio
import contextlib
import os
import shutil
import signal
import urllib.parse
import uuid

import numpy as np
import pytest

from tf_dpiter.draw_discard import cli, parsing, service
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.draw_discard import store_factory

from tests.draw_discard.conftest import honest, start_redis

SPEC = cli.dense_spec(17, epsilon=1.0, gamma=0.01)
SECRET = bytes(range(32, 64))


class Cluster:
  """One redis-server (restartable from its RDB snapshot) and one key prefix."""

  def __init__(self, url, proc, data_dir):
    self.url, self.proc, self.dir = url, proc, data_dir
    self.prefix = f"t{uuid.uuid4().hex[:8]}"
    self.rng = np.random.default_rng(9)

  def svc(self, state_file=None, **kw):
    return service.DDMLService(SPEC, 5, store_factory.make_store(self.url, self.prefix), seed=0,
                               secret=SECRET, influence_steps=None, state_file=state_file,
                               **kw)

  async def updates(self, n, state_file=None, crash=False, **kw):
    """Starts a server, makes n acknowledged updates, stops it (crash: as kill -9 would)."""
    svc = self.svc(state_file, **kw)
    await svc.startup()
    try:
      for _ in range(n):
        h, ticket = await svc.draw_for("me")
        await svc.store_ticketed("me", parsing.Submission(honest(SPEC, h, self.rng), h, ticket))
      return await svc.store.touch()
    finally:
      if crash:  # no final anchor write, no goodbye
        task = getattr(svc, "_anchor_task", None)
        if task is not None:
          task.cancel()
        if svc.anchor is not None:  # the process is gone: the kernel closes its files and
          svc.anchor.close()        # drops the anchor's lock (no final save)
        await svc.store.close()
      else:
        await svc.shutdown()

  def run(self, n, state_file=None, **kw):
    return asyncio.run(self.updates(n, state_file, **kw))

  def save(self):
    r = self.redis()
    r.save()
    r.close()

  def redis(self):
    import redis
    return redis.Redis.from_url(self.url)

  def kill_and_restore(self):
    """kill -9 of redis-server, then a restart from the last SAVE."""
    self.proc.send_signal(signal.SIGKILL)
    self.proc.wait(10)
    self.proc = start_redis(urllib.parse.urlparse(self.url).port, self.dir)


@pytest.fixture
def cluster(own_redis, tmp_path):
  url, proc = own_redis
  c = Cluster(url, proc, tmp_path)
  yield c
  if c.proc.poll() is None:
    c.proc.terminate()
    c.proc.wait(10)


def test_kill_9_of_server_and_redis_after_acknowledged_updates_is_detected(cluster, tmp_path):
  anchor = str(tmp_path / "a.json")
  assert cluster.run(2, anchor) == 2
  cluster.save()  # what Redis will come back with
  assert cluster.run(3, anchor, crash=True) == 5  # acknowledged, then kill -9 of the server
  cluster.kill_and_restore()  # ... and of Redis: back at seq 2
  with pytest.raises(store_lib.StoreRolledBack, match="below 5"):
    cluster.run(0, anchor)


def test_a_deleted_anchor_is_refused_until_adopted(cluster, tmp_path):
  anchor = tmp_path / "a.json"
  cluster.run(3, str(anchor))
  os.remove(anchor)
  with pytest.raises(store_lib.StoreRolledBack, match="does not exist"):
    cluster.run(1, str(anchor))
  assert cluster.run(1, str(anchor), adopt_state=True) == 4  # the operator's decision
  assert cluster.run(1, str(anchor)) == 5


def test_a_store_flushed_and_recreated_is_refused(cluster, tmp_path):
  anchor = str(tmp_path / "a.json")
  cluster.run(3, anchor)
  r = cluster.redis()
  r.flushall()
  r.close()
  with pytest.raises(store_lib.StoreRolledBack, match="another server|flushed"):
    cluster.run(0, anchor)


@pytest.mark.parametrize("restarted_with", ["restored_anchor", "no_anchor"])
def test_sequence_numbers_reissued_after_a_rollback_are_detected_by_a_peer(
    cluster, tmp_path, restarted_with):
  """Server A's anchor is restored together with Redis (or A runs without one); A
  re-issues sequence numbers past server B's anchor; B must refuse at its next start."""
  a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
  assert cluster.run(0, b) == 0  # B initializes the store, A joins it at seq 0
  assert cluster.run(2, a) == 2
  cluster.save()
  shutil.copy(a, a + ".bak")
  assert cluster.run(4, b) == 6  # B's acknowledged updates 3..6
  cluster.kill_and_restore()  # Redis back at seq 2
  os.replace(a + ".bak", a)
  assert cluster.run(5, a if restarted_with == "restored_anchor" else None) == 7
  with pytest.raises(store_lib.StoreRolledBack, match="re-issued"):
    cluster.run(0, b)


def test_a_deleted_nonce_does_not_readmit_its_ticket(cluster):
  async def go():
    svc = cluster.svc()
    await svc.startup()
    try:
      h, ticket = await svc.draw_for("me")
      sub = parsing.Submission(honest(SPEC, h, cluster.rng), h, ticket)
      await svc.store_ticketed("me", sub)
      r = cluster.redis()
      keys = r.keys(f"{cluster.prefix}:nonce:*")
      assert len(keys) == 1
      r.delete(*keys)
      r.close()
      with pytest.raises(parsing.RequestError) as e:
        await svc.store_ticketed("me", sub)
      assert (e.value.status, e.value.code) == (409, "ticket_used")
      assert await svc.store.touch() == 1
    finally:
      await svc.shutdown()

  asyncio.run(go())


def test_an_older_value_written_back_into_a_slot_is_refused(cluster):
  """A writer of Redis (without the secret) puts a slot's own earlier sealed value back."""
  async def go():
    svc = cluster.svc()
    await svc.startup()
    try:
      r = cluster.redis()
      keys = [f"{cluster.prefix}:slot:{i}" for i in range(svc.k)]
      before = r.mget(keys)
      for _ in range(20):
        h, ticket = await svc.draw_for("me")
        await svc.store_ticketed("me", parsing.Submission(honest(SPEC, h, cluster.rng), h, ticket))
      await svc.store.snapshot()  # untouched: fine
      now = r.mget(keys)
      i = next(j for j in range(svc.k) if now[j] != before[j])
      r.set(keys[i], before[i])  # valid tag, right slot index, right generation: but old
      r.close()
      with pytest.raises(store_lib.StoreCorrupt, match=f"slot {i} holds a value that an earlier"):
        await svc.store.snapshot()
    finally:
      await svc.shutdown()

  asyncio.run(go())


def test_a_snapshot_read_before_a_replacement_is_not_taken_for_a_replay(cluster):
  """The replacement's reply (which retires the old value) is processed before the older
  snapshot that still holds that value: a benign race, not a fault."""
  async def go():
    svc = cluster.svc()
    await svc.startup()
    store = svc.store
    script = store._snapshot

    async def read_then_replace(**kw):
      out = await script(**kw)  # slots at seq s
      await store.replace(3, np.zeros(SPEC.num_weights))  # seq s + 1 retires slot 3's value
      return out

    try:
      store._snapshot = read_then_replace
      snap = await store.snapshot()
      store._snapshot = script
      assert snap.seq == 0 and await store.touch() == 1
      assert not np.array_equal(snap.slots[3], np.zeros(SPEC.num_weights))
      assert (await store.snapshot()).seq == 1
    finally:
      await svc.shutdown()

  asyncio.run(go())


def test_a_server_that_checked_before_another_initialized_joins_it(cluster):
  """B finds no model, A initializes (and frees the lock), B takes the free lock: B must
  join A's model, not initialize a second one under A (A would then be refused)."""
  async def go():
    a, b = cluster.svc(), cluster.svc()
    await a.startup()
    real = b.store._r.exists
    calls = []

    async def first_check_too_early(*keys):
      calls.append(keys)
      return 0 if len(calls) == 1 else await real(*keys)

    b.store._r.exists = first_check_too_early
    try:
      await b.startup()
      assert b.store.generation == a.store.generation
      assert await a.store.touch() == 0  # A's generation still holds
    finally:
      await a.shutdown()
      await b.shutdown()

  asyncio.run(go())


def test_anchor_keeps_the_older_record_when_the_newest_is_torn(tmp_path):
  from tf_dpiter.draw_discard import anchor as anchor_lib
  path = tmp_path / "a.json"
  path.write_text('{"generation": "g", "seq": 3}')  # an older version's anchor
  a = anchor_lib.Anchor(str(path))
  assert a.load()["seq"] == 3
  for seq in (4, 5, 6):
    a.save("g", seq)
  a.close()
  raw = bytearray(path.read_bytes())
  n = anchor_lib.Anchor(str(path)).load()["n"]
  raw[(n % 2) * 256 + 30] ^= 1  # the newest record torn by a crash mid-write
  path.write_bytes(bytes(raw))
  assert anchor_lib.Anchor(str(path)).load()["seq"] == 5
  path.write_text("not an anchor")
  with pytest.raises(ValueError, match="not an anchor file"):
    anchor_lib.Anchor(str(path)).load()


def test_two_servers_on_one_state_file_the_second_is_refused(cluster, tmp_path):
  """Two writers of one anchor overwrite each other's records (the newest counter wins on
  load, not the highest sequence number): measured before the lock, A anchored 6 updates, B
  acknowledged seq 7, the file then loaded seq 5. The second server is refused instead."""
  state = str(tmp_path / "shared.anchor")

  async def go():
    a, b = cluster.svc(state), cluster.svc(state)
    await a.startup()
    try:
      with pytest.raises(ValueError, match="in use by another server"):
        await b.startup()
      h, ticket = await a.draw_for("me")  # A still serves and anchors
      seq = await a.store_ticketed("me", parsing.Submission(honest(SPEC, h, cluster.rng), h,
                                                              ticket))
      assert seq == 1
    finally:
      await a.shutdown()
    c = cluster.svc(state)  # A released the lock at shutdown
    await c.startup()
    await c.shutdown()

  asyncio.run(go())


def test_the_anchor_lock_dies_with_its_process(tmp_path):
  """kill -9 of the holder: the kernel drops the flock, a restarted server takes it."""
  import subprocess
  import sys
  from tf_dpiter.draw_discard import anchor as anchor_lib
  path = str(tmp_path / "a.anchor")
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from tf_dpiter.draw_discard import anchor; "
       f"a = anchor.Anchor({path!r}); a.lock(); print('locked', flush=True); time.sleep(60)"],
      stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=os.getcwd()))
  try:
    assert holder.stdout.readline().strip() == b"locked"
    with pytest.raises(ValueError, match="in use by another server"):
      anchor_lib.Anchor(path).lock()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
  a = anchor_lib.Anchor(path)
  a.lock()
  a.close()


def test_an_update_stored_but_not_anchored_stays_in_the_influence_budget(cluster, tmp_path,
                                                                          monkeypatch):
  """The anchor write fails (ENOSPC) after the store took the update: the client gets 503
  update_not_acknowledged, its ticket is used, and the step stays in its identity's influence
  budget. Before: the budget refunded it, so each such update escaped the envelope (3 stored
  updates, budget count 0)."""
  from tf_dpiter.draw_discard import anchor as anchor_lib
  from tf_dpiter.draw_discard import sybil

  async def go():
    svc = cluster.svc(str(tmp_path / "a.anchor"))
    await svc.startup()
    try:
      def full_disk(*a, **kw):
        raise OSError(28, "No space left on device")
      monkeypatch.setattr(anchor_lib.Anchor, "save", full_disk)
      for i in range(3):
        h, ticket = await svc.draw_for("127.0.0.1")
        sub = parsing.Submission(honest(SPEC, h, cluster.rng), h, ticket)
        with pytest.raises(store_lib.StoredNotAcknowledged):
          await svc.store_ticketed("127.0.0.1", sub)
        assert (await svc.store.counters())["seq"] == i + 1  # it is in the store
        with pytest.raises(parsing.RequestError, match="ticket_used"):
          await svc.store_ticketed("127.0.0.1", sub)
      assert svc.budget.state(sybil.budget_key("127.0.0.1", False))[0] == 3
    finally:
      monkeypatch.undo()
      await svc.shutdown()

  asyncio.run(go())


def test_a_write_with_unknown_outcome_stays_in_the_influence_budget(monkeypatch):
  """The store took the update but its answer timed out (StoreUnavailable after the write):
  the outcome is unknown to the server, so the step is kept in the identity's budget (an
  honest client loses one step of budget at worst). Before: refunded, so every timed-out
  write that did land escaped the influence envelope (budget count 0 for 2 stored updates)."""
  from tf_dpiter.draw_discard import sybil

  async def go():
    svc = service.DDMLService(SPEC, 5, store_lib.MemoryStore(), seed=0, secret=SECRET,
                              influence_steps=None)
    await svc.startup()
    real = svc.store.replace

    async def lands_then_times_out(*a, **kw):
      await real(*a, **kw)
      raise store_lib.StoreUnavailable("redis: TimeoutError (simulated, after the write)")

    monkeypatch.setattr(svc.store, "replace", lands_then_times_out)
    rng = np.random.default_rng(4)
    for i in range(2):
      h, ticket = await svc.draw_for("127.0.0.1")
      with pytest.raises(store_lib.StoreUnavailable):
        await svc.store_ticketed("127.0.0.1",
                                 parsing.Submission(honest(SPEC, h, rng), h, ticket))
      assert (await svc.store.counters())["seq"] == i + 1
    assert svc.budget.state(sybil.budget_key("127.0.0.1", False))[0] == 2
    # a fault before the write (the rebase read) still refunds: nothing can have landed
    monkeypatch.setattr(svc.store, "replace", real)

    async def unreachable(*a, **kw):
      raise store_lib.StoreUnavailable("redis: ConnectionError (simulated)")

    monkeypatch.setattr(svc.snapshots, "recent", unreachable)
    h, ticket = await svc.draw_for("127.0.0.1")
    with pytest.raises(store_lib.StoreUnavailable):
      await svc.store_ticketed("127.0.0.1", parsing.Submission(honest(SPEC, h, rng), h, ticket))
    assert svc.budget.state(sybil.budget_key("127.0.0.1", False))[0] == 2
    await svc.shutdown()

  asyncio.run(go())


def test_a_file_system_without_flock_warns_and_keeps_the_anchor(tmp_path, monkeypatch, caplog):
  """ENOLCK (a network file system without locks) must not stop the server: before this
  test's fix the new lock would have made such a start fail with OSError."""
  import errno
  import fcntl
  import logging
  from tf_dpiter.draw_discard import anchor as anchor_lib

  def no_locks(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")

  monkeypatch.setattr(fcntl, "flock", no_locks)
  caplog.set_level(logging.WARNING)
  a = anchor_lib.Anchor(str(tmp_path / "a.anchor"))
  a.lock()
  a.save("g", 4)
  a.close()
  assert anchor_lib.Anchor(str(tmp_path / "a.anchor")).load()["seq"] == 4
  assert "state_file_not_locked" in caplog.text


@pytest.mark.parametrize("fault", [RuntimeError("simulated fault after the write"),
                                   asyncio.CancelledError()],
                         ids=["fault", "cancelled"])
def test_a_submit_interrupted_after_its_write_keeps_its_step_and_its_draws_count_once(fault):
  """A submit that dies after its write reached the store (an unexpected error, or the
  handler cancelled while the store's answer was on its way, e.g. at shutdown): the update
  is stored, so its step stays in the identity's influence budget and the draws the write
  carried are not queued to be counted again. Before: every exception but StoreUnavailable
  refunded the step (budget count 0 for a stored update) and re-queued the draws (the store's
  draw counter would count them twice)."""
  from tf_dpiter.draw_discard import sybil

  async def go():
    svc = service.DDMLService(SPEC, 5, store_lib.MemoryStore(), seed=0, secret=SECRET,
                              influence_steps=None)
    await svc.startup()
    real = svc.store.replace

    async def lands_then_dies(*a, **kw):
      await real(*a, **kw)
      raise fault

    svc.store.replace = lands_then_dies
    h, ticket = await svc.draw_for("127.0.0.1")
    svc._pending_draws = 3  # draws served since the last store call, carried by this write
    drawn = (await svc.store.counters())["draws"]
    with pytest.raises(type(fault)):
      await svc.store_ticketed("127.0.0.1", parsing.Submission(
          honest(SPEC, h, np.random.default_rng(5)), h, ticket))
    counters = await svc.store.counters()
    assert counters["seq"] == 1 and counters["draws"] == drawn + 3
    assert svc._pending_draws == 0
    assert svc.budget.state(sybil.budget_key("127.0.0.1", False))[0] == 1
    await svc.shutdown()

  asyncio.run(go())


def _refused_replaces(k, p):
  """replace() calls a store must refuse before writing anything: a wrong-shaped instance
  (with a nonce and draws to carry) and slots outside 0..k-1."""
  return [dict(i=0, w=np.zeros(p + 1), nonce="n0", draws=3), dict(i=0, w=np.zeros((1, p))),
          dict(i=k, w=np.zeros(p)), dict(i=-1, w=np.zeros(p))]


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_refused_replace_writes_nothing(kind, request):
  """replace() of a wrong-shaped instance or of a slot outside 0..k-1 raises
  ParameterValueError before its first write. Before: the memory store marked the nonce
  used, counted the draws and pushed the slot into the history, then failed on the write
  (ValueError), and took slot k for a history row (written without error); the Redis store
  sealed and stored a [p + 1] value, after which every read of the model failed its
  integrity check (StoreCorrupt: the store lost for every server)."""
  from tf_dpiter.errors import ParameterValueError

  async def go(store):
    svc = service.DDMLService(SPEC, 5, store, seed=0, secret=SECRET, influence_steps=None,
                              history=2, tickets=False)
    await svc.startup()
    try:
      before = await svc.store.snapshot()
      before = (before.seq, before.slots.tobytes(), before.history.tobytes())
      counters = await svc.store.counters()
      for call in _refused_replaces(svc.k, svc.p):
        with pytest.raises(ParameterValueError, match="`(w|i)` must be"):
          await svc.store.replace(**call)
      snap = await svc.store.snapshot()
      assert (snap.seq, snap.slots.tobytes(), snap.history.tobytes()) == before
      assert await svc.store.counters() == counters
      assert await svc.store.replace(0, np.ones(svc.p), nonce="n0") == 1  # nonce not used up
    finally:
      await svc.shutdown()

  if kind == "memory":
    asyncio.run(go(store_lib.MemoryStore()))
  else:
    cluster = request.getfixturevalue("cluster")
    asyncio.run(go(store_factory.make_store(cluster.url, cluster.prefix)))


def test_a_state_file_named_through_a_symlink_is_locked_as_itself(tmp_path):
  """A second server given a symlink to the first's state file is refused like one given
  the same path. Before: the lock was `<path given>.lock`, so the symlink's lock was another
  file; both servers took theirs and wrote records into the one anchor (the newest counter
  wins on load: the server behind could make the other's anchor read below a sequence
  number it acknowledged, here 7 anchored by A, 5 loaded)."""
  from tf_dpiter.draw_discard import anchor as anchor_lib
  real, link = tmp_path / "a.anchor", tmp_path / "b.anchor"
  a = anchor_lib.Anchor(str(real))
  a.lock()
  a.save("g", 7)
  a.save("g", 7)  # the file exists, both records written: saves are in place from now on
  link.symlink_to(real)
  b = anchor_lib.Anchor(str(link))
  try:
    with pytest.raises(ValueError, match="in use by another server"):
      b.lock()
  finally:
    b.close()
  assert anchor_lib.Anchor(str(real)).load()["seq"] == 7
  a.close()
  b = anchor_lib.Anchor(str(link))  # A released it: the symlink's server may now use it
  b.lock()
  b.close()


def test_sequence_numbers_reissued_by_a_running_peer_after_a_rollback_are_detected(
    cluster, tmp_path):
  """Server B runs throughout but makes no store call while A acknowledges updates 4..6;
  Redis comes back at seq 3; B (high-water mark 0: it cannot see the rollback) re-issues
  4..7 without restarting, so no epoch entry tells. A must refuse at its next start. Before:
  A started on seq 7 >= 6 with its epoch entry intact and served the rolled-back store."""
  a_file, b_file = str(tmp_path / "a.anchor"), str(tmp_path / "b.anchor")

  async def updates(svc, n):
    for _ in range(n):
      h, ticket = await svc.draw_for("me")
      await svc.store_ticketed("me", parsing.Submission(honest(SPEC, h, cluster.rng), h, ticket))

  async def go():
    a, b = cluster.svc(a_file), cluster.svc(b_file)
    await a.startup()
    await b.startup()
    await updates(a, 3)
    cluster.save()  # what Redis will come back with: seq 3
    await updates(a, 3)  # acknowledged 4..6
    await a.shutdown()
    cluster.kill_and_restore()
    # B's pooled connection to the old Redis fails its first call, or B reconnects at once
    # (a CI run under load: no error): either way B goes on without restarting
    with contextlib.suppress(store_lib.StoreUnavailable):
      await b.draw_for("me")
    await updates(b, 4)  # 4..7 re-issued
    assert await b.store.touch() == 7
    await b.shutdown()
    with pytest.raises(store_lib.StoreRolledBack, match="re-issued"):
      await cluster.svc(a_file).startup()

  asyncio.run(go())
