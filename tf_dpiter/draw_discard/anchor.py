"""A local anchor of the store's sequence number: a lost acknowledged update is detected.

With `serve --state-file PATH` the server records {"generation", "seq", "epochs",
"last_epoch"} on its own disk (two checksummed records written in turn, fdatasynced; group
commit per event-loop turn) **before acknowledging an update** (RedisStore.replace awaits
`commit`). At start-up it refuses (StoreRolledBack) a store below the anchored seq, a store
of another generation unless it reset it itself, and, without an anchor file, a store that
already holds updates (unless `adopt=True`, `--adopt-store`). Every server start appends an
epoch `id:seq` to the store; the anchor keeps the list's length n and last entry, so a
rollback before the anchored seq followed by any server start breaks entry n - 1 or the
order of later entries. Each anchor file has a random id, and before each write the server
raises its mark in the store (`<prefix>:mark:<generation>:<id>`) to the sequence number it
records: a store that holds a lower mark than the anchor was rolled back, also when a peer
that never restarted has re-issued the lost sequence numbers since. A server holds an
exclusive lock (flock) on `PATH.lock` (PATH with its symlinks resolved) from start-up to
shutdown: a second server given the same state file is refused, since two writers of one
anchor overwrite each other's records and can leave one below an acknowledged sequence
number. Residual risk: docs/draw_discard_security.md, section 1.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import uuid

from tf_dpiter import files
from tf_dpiter.draw_discard import store as store_lib
from tf_dpiter.errors import ParameterValueError

log = logging.getLogger(__name__)

_FIELDS = ("generation", "seq")
_REC = 256  # bytes per record; the file holds two


def _record(data: dict, n: int) -> bytes:
  """One record: BLAKE2b-64 (hex) of the JSON, the JSON, padded to _REC bytes."""
  body = json.dumps(dict(data, n=n), sort_keys=True).encode()
  rec = hashlib.blake2b(body, digest_size=8).hexdigest().encode() + body
  if len(rec) >= _REC:
    raise ParameterValueError(f"anchor record of {len(rec)} bytes does not fit {_REC}")
  return rec.ljust(_REC - 1) + b"\n"


def _parse(rec: bytes) -> dict | None:
  """The record's data, or None when its checksum does not hold (torn, blank, foreign)."""
  rec = rec.rstrip()
  digest, body = rec[:16], rec[16:]
  if not body or hashlib.blake2b(body, digest_size=8).hexdigest().encode() != digest:
    return None
  try:
    data = json.loads(body)
  except ValueError:
    return None
  return data if isinstance(data, dict) else None


class Anchor:
  """The anchor file of one server.

  Args:
    path: the file (created on the first save); symlinks are resolved once, here, so that
      the lock, the reads and the writes are those of the file itself (two servers given
      two names of one file are refused like two given one name).
    adopt: at start-up, accept the store as it is when the anchor is missing or records
      another generation (the operator's decision, e.g. a new server joining).
  """

  def __init__(self, path: str, adopt: bool = False):
    self.path = os.path.realpath(path)
    self.adopt = bool(adopt)
    self._saved: tuple | None = None  # (generation, seq) on disk
    self._fd: int | None = None  # the file, open for in-place saves
    self._counter = 0  # n of the newest record
    self._waiters: list = []  # (seq, future) waiting for the next write
    self._writer: asyncio.Future | None = None
    self._lock_file = None  # PATH.lock, flocked while this server uses the anchor
    self.id: str | None = None  # this anchor's mark in the store (load, or start: a new one)

  def lock(self) -> None:
    """Takes the exclusive lock of the anchor (`PATH.lock`, kept until `close`; the kernel
    drops it when the process dies, kill -9 included).

    A file system without flock (some network file systems: ENOLCK, EOPNOTSUPP) gets a
    warning and no lock: the anchor works as before, unguarded against a second server.

    Raises:
      ParameterValueError: another process (or another Anchor of this one) holds it.
      OSError: the lock file cannot be created.
    """
    if self._lock_file is not None:
      return
    f = open(self.path + ".lock", "ab")  # pylint: disable=consider-using-with  (kept open)
    try:
      fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
      f.close()
      raise ParameterValueError(
          f"`state_file` is in use by another server (its lock {self.path + '.lock'!r} is "
          "held): every server of a store needs its own state file, two writers of one "
          f"anchor can record a sequence number below an acknowledged one. Received: "
          f"state_file={self.path!r}") from e
    except OSError as e:
      if e.errno not in files.NO_FLOCK_ERRNOS:
        f.close()
        raise
      log.warning(json.dumps({"event": "state_file_not_locked", "errno": e.errno,
                              "detail": "this file system has no flock: a second server "
                                        "given the same state file is not refused"}))
    self._lock_file = f

  def load(self) -> dict | None:
    """The newest intact record of the file (see save; or one JSON object), {"generation",
    "seq"[, "epochs", "last_epoch"]}; None without file.

    Raises:
      OSError: when the file exists but cannot be read.
      ParameterValueError: when it is not an anchor file.
    """
    if not os.path.exists(self.path):
      return None
    with open(self.path, "rb") as f:
      raw = f.read()
    if raw.lstrip().startswith(b"{"):  # an older version's anchor: one JSON object
      try:
        data = json.loads(raw)
      except ValueError:
        data = None
    else:
      records = [r for r in (_parse(raw[:_REC]), _parse(raw[_REC:2 * _REC])) if r is not None]
      data = max(records, key=lambda r: r.get("n", 0)) if records else None
    if not isinstance(data, dict) or any(k not in data for k in _FIELDS):
      raise ParameterValueError(f"`state_file` {self.path!r} is not an anchor file; restore "
                                "it, or remove it and start with --adopt-store")
    self._counter = max(self._counter, int(data.get("n", 0)))
    self.id = data.get("id") or self.id
    return data

  def _refuse(self, what: str) -> None:
    raise store_lib.StoreRolledBack(
        f"{what}; acknowledged updates may be lost. Check the store; to accept it as it is, "
        f"start this server once with --adopt-store (anchor {self.path!r})")

  async def check(self, store, wrote: bool, reset: bool) -> int:
    """Start-up check of a RedisStore just initialized (`wrote`: this start wrote a fresh
    model) or joined, against the anchor (`reset`: --reset was asked); returns the anchored
    sequence number (0 when none applies).

    Raises:
      store.StoreRolledBack: see the module docstring.
    """
    rec = self.load()
    seq, _, _ = await store.epochs()
    if self.adopt:
      return 0
    if rec is None:
      if not wrote and seq > 0:
        self._refuse(f"the anchor file {self.path!r} does not exist but the store already "
                     f"holds {seq} updates (the anchor was deleted, or this server is new to "
                     "the store)")
      return 0
    if rec["generation"] != store.generation:
      if not (wrote and reset) and int(rec["seq"]) > 0:
        self._refuse(f"the anchor records generation {rec['generation']} at sequence number "
                     f"{rec['seq']} but the store holds generation {store.generation} (it was "
                     "flushed and re-created, or re-initialized by another server)")
      return 0
    anchored = int(rec["seq"])
    if seq < anchored:
      self._refuse(f"the store's sequence number is {seq}, below {anchored} recorded in "
                   f"{self.path!r} by this server: the store was rolled back while it was down")
    mark = await store.anchor_mark(rec["id"]) if rec.get("id") else anchored
    if anchored > 0 and (mark is None or mark < anchored):
      self._refuse(f"the store's mark of this anchor is {mark}, below {anchored} recorded in "
                   f"{self.path!r}: the store was rolled back and its sequence numbers "
                   "re-issued")
    n = int(rec.get("epochs", 0))
    if n > 0:
      entries = await store.epoch_entries(n - 1)
      if not entries or entries[0] != rec.get("last_epoch"):
        self._refuse("the store's epoch list no longer holds the entry this server anchored: "
                     "the store was rolled back and its sequence numbers re-issued")
      for entry in entries[1:]:
        if int(entry.rsplit(":", 1)[1]) < anchored:
          self._refuse(f"a server started on the store at sequence number "
                       f"{entry.rsplit(':', 1)[1]}, below {anchored} anchored here: the store "
                       "was rolled back and its sequence numbers re-issued")
    return anchored

  async def start(self, store, wrote: bool, reset: bool) -> None:
    """check(), then this start's epoch entry, the high-water mark and a first anchor.

    Raises:
      store.StoreRolledBack: see check().
      ParameterValueError: another server holds the anchor's lock (`lock`).
    """
    self.lock()
    try:
      anchored = await self.check(store, wrote, reset)
      self.id = self.id or uuid.uuid4().hex[:16]
      store.high_water = max(store.high_water, anchored)
      await store.epochs(new_epoch=uuid.uuid4().hex[:16])
      store.anchor = self
      await self.commit(store, store.high_water)
    except BaseException:
      self.close()  # a refused start holds no lock
      raise

  def save(self, generation: str, seq: int, epochs: int = 0, last_epoch: str = "") -> None:
    """Writes the anchor (the store's generation, the highest `seq`, never lowered within a
    generation, and the epoch list's length and last entry read after `seq` was seen) durably
    (fdatasync) without a window where none is on disk.

    The file holds two records of _REC bytes, each `BLAKE2b-64 hex | JSON` with a counter
    n; a save overwrites the older one in place and fdatasyncs, so a torn write leaves the
    other intact; n advances only when the write succeeded. The file itself is created (or
    converted from one JSON object) atomically (`files.replaced`).
    """
    if self._saved is not None and self._saved[0] == generation:
      seq = max(seq, self._saved[1])
    data = {"generation": generation, "seq": int(seq), "epochs": int(epochs),
            "last_epoch": last_epoch}
    if self.id:
      data["id"] = self.id
    if self._fd is None and self._in_place():
      self._fd = os.open(self.path, os.O_RDWR)
    if self._fd is None:
      with files.replaced(self.path) as tmp, open(tmp, "wb") as f:
        f.write(_record(data, 0) + b" " * (_REC - 1) + b"\n")
      self._counter = 0  # the record just written: slot 0, n = 0
      self._fd = os.open(self.path, os.O_RDWR)
    else:
      n = self._counter + 1  # record n goes to slot n % 2: the older of the two
      os.pwrite(self._fd, _record(data, n), (n % 2) * _REC)
      os.fdatasync(self._fd)
      self._counter = n  # only now: after a failed write the retry goes to the same (torn)
      # slot, never onto the newest intact record
    self._saved = (generation, int(seq))

  def _in_place(self) -> bool:
    """Whether the file exists in the two-record format (else save rewrites it whole)."""
    try:
      with open(self.path, "rb") as f:
        head = f.read(2 * _REC)
    except FileNotFoundError:
      return False
    return len(head) == 2 * _REC and _parse(head[:_REC]) is not None

  def close(self) -> None:
    """Closes the file (after the last save) and releases the lock."""
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None
    if self._lock_file is not None:
      self._lock_file.close()  # closing the descriptor releases the flock
      self._lock_file = None

  async def commit(self, store, seq: int) -> None:
    """Returns once the anchor on disk holds at least `seq` (one write per batch; the
    RedisStore's epoch list is read for each write).

    Raises:
      store.StoreUnavailable: the anchor file cannot be written (the update is stored
        but must not be acknowledged).
      store.StoreLost: the store's checks failed while reading the epoch list.
    """
    if self._saved is not None and self._saved[0] == store.generation and self._saved[1] >= seq:
      return
    fut = asyncio.get_running_loop().create_future()
    self._waiters.append((int(seq), fut))
    if self._writer is None:
      self._writer = asyncio.ensure_future(self._drain(store))
    await fut

  async def _drain(self, store) -> None:
    try:
      while self._waiters:
        batch, self._waiters = self._waiters, []
        target = max(s for s, _ in batch)
        try:
          _, n, last = await store.epochs(mark=(self.id, target) if self.id else None)
          await asyncio.to_thread(self.save, store.generation, target, n, last)
        except (store_lib.StoreLost, store_lib.StoreUnavailable) as e:
          _settle(batch, e)
        except OSError as e:
          _settle(batch, store_lib.StoreUnavailable(
              f"anchor file {self.path!r} cannot be written ({e}); updates are not "
              "acknowledged until it can"))
        else:
          _settle(batch, None)
    finally:
      self._writer = None

  async def run(self, store, every_s: float = 1.0) -> None:
    """Anchors the RedisStore's high-water mark every `every_s` seconds (cancel to stop)."""
    while True:
      await asyncio.sleep(every_s)
      try:
        await self.commit(store, store.high_water)
      except (store_lib.StoreLost, store_lib.StoreUnavailable):
        pass  # refused requests report it; the next tick retries


def _settle(batch: list, error: BaseException | None) -> None:
  for _, fut in batch:
    if fut.done():
      continue
    if error is None:
      fut.set_result(None)
    else:
      fut.set_exception(error)
