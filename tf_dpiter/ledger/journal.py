"""An append-only journal of a ledger, so that a crash loses no step.

Rule: every noised step ever taken is charged. The journal is appended (and fsynced) after
every training step; steps re-run from an older backup are charged again, so after any number
of crashes the ledger holds every step taken.

File: JSON lines, one chunk per append: {"seq", "start", "passes", "iterations", "prev",
"runs", ..., "digest"[, "hmac"]}, each a signed ledger dict (`ledger_file`) of its samples,
with the pass total and optimizer iterations at the append and "prev" the previous chunk's
digest, so that removing, reordering or editing a chunk is detected. A chunk also carries the
ledger's cyclic grouping record (`PrivacyLedger.cyclic_grouping`) when it has one; `resume`
merges the last chunk's into the ledger with its rows.

A chunk holds what the ledger holds beyond the journal: the rows it appended since the last
chunk, or, after a merge put another run's rows among the ledger's, per run identity what its
views hold beyond the journal's (`run_ids.additions`); the chunk's run table is the journal's
own. So the journal holds the ledger's runs, each once, in whatever order the ledger holds
them. An earlier version's journal (no run table) holds its rows as one run under an identity
drawn by `resume` (`run_ids.fresh`), which its next chunk writes down.

A cut tail leaves a valid chain (a chain proves what it holds, not that nothing came after):
`check_covers(iterations)` refuses a journal that ends before the restored model's
iterations. Steps taken after the restored checkpoint and cut from the journal cannot be told
from steps never taken: keep the journal on append-only storage when that matters.

One writer per journal: an append refuses a file whose size or last bytes are not the ones its
journal last read or wrote, and holds an exclusive flock from that check to its fsync, so two
runs or servers on one file cannot each leave out the other's steps; a last line torn by a
crash, dropped by `read`, is cut off at the next append.
"""

import fcntl
import json
import os
import warnings

from tf_dpiter import files
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import ledger_file
from tf_dpiter.ledger import privacy_ledger
from tf_dpiter.ledger import records as rec
from tf_dpiter.ledger import run_ids

# A chunk's field holding the run table (`run_ids`) of the whole ledger at the append: the
# resume merges the journal under the identities of its last chunk (none: a run of its own).
TABLE_FIELD = "ledger_run_ids"

# The file's last bytes a journal compares before it appends (`_check_unchanged`), besides its
# size: fewer than a chunk's line holds (its digest alone is 71).
_TAIL = 64


class LedgerJournal:
  """Append-only, hash-chained file of a ledger's samples.

  Args:
    path: the journal file (created on the first append).
    key: optional str/bytes: each chunk also carries an HMAC under it.
    tally: keep the tally `PATH.tally` beside the journal (the number of chunks and the last
      chunk's digest, replaced whole after every append): `read` then refuses a journal that
      holds fewer chunks than the tally counts, or other ones (whole chunks cut from its end,
      or an older copy put in place). A federated server's journal has one; a step's append
      stays one fsync without it.
  """

  def __init__(self, path, key=None, tally=False):
    self.path = os.fspath(path)
    self.key = key
    self.tally = bool(tally)
    self._written = 0          # samples already in the file
    self._last_digest = None
    self._seq = 0
    self._passes_written = 0
    self._iterations = None    # the last chunk's optimizer iterations (None: not recorded)
    self._chunk_iterations = set()   # every optimizer iteration a chunk recorded
    self._grouping = None      # the last chunk's cyclic grouping record
    self._table = None         # the last chunk's run table of the whole journal (or None)
    # an earlier version's journal (no run table) resumed: its rows as one run drawn then
    # (`run_ids.fresh`), the table the next append writes for them
    self._fresh = None
    # (run table, samples) of the ledger state the journal holds in the ledger's own row
    # order, so that what the ledger appends after it is new (None: not known)
    self._seen = ((), 0)
    self._torn_at = None       # bytes before a last line torn by a crash (cut at the append)
    self._size = 0             # the file's bytes as this object last read or wrote them
    self._tail = b""           # the file's last _TAIL bytes then
    self._read_done = False    # `read` ran (then only `_check_unchanged` looks at the file)

  @property
  def iterations(self):
    """The optimizer iterations of the last chunk read or written (None: none recorded)."""
    return self._iterations

  @property
  def samples(self):
    """Samples (ledger rows) in the file, as last read or written."""
    return self._written

  def read(self):
    """(samples, queries, passes) of everything in the file, checked against alteration.

    Raises:
      ParameterValueError: a line that is not JSON, or a file that was altered.
    """
    runs, passes = [], 0
    self._written, self._last_digest, self._seq, self._passes_written = 0, None, 0, 0
    self._iterations, self._chunk_iterations, self._grouping = None, set(), None
    self._table, self._torn_at, self._size, self._read_done = None, None, 0, True
    self._tail = b""
    self._seen = None
    if not os.path.exists(self.path):
      self._check_tally()   # a journal removed whole beside its tally
      return (*rec.runs_to_arrays([]), 0)
    with open(self.path, "rb") as f:   # bytes: only b"\n" ends a line, a torn tail may hold any
      data = f.read()
      self._size = os.fstat(f.fileno()).st_size
    self._tail = data[-_TAIL:]
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
      lines.pop()
    elif lines:
      warnings.warn(f"ledger journal {self.path!r}: the last line was cut by a crash while it "
                    "was written; it is dropped (it held at most the last step)", RuntimeWarning)
      lines.pop()
      self._torn_at = self._size - (len(data) - data.rfind(b"\n") - 1)
    for i, line in enumerate(lines):
      try:
        chunk = json.loads(line)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ParameterValueError(f"ledger journal {self.path!r} line {i + 1} is not JSON: {e}") from None
      self._check_chain(chunk, i)
      chunk_runs, chunk_passes = ledger_file.dict_to_runs(chunk, self.key)
      self._grouping = ledger_file.check_grouping(chunk.get(ledger_file.GROUPING_FIELD),
                                                  self._where(i)) or self._grouping
      runs.extend(chunk_runs)
      passes = max(passes, chunk_passes)
      self._passes_written = passes
      self._written += chunk["num_samples"] + ("selection" in chunk)   # + its marker row
      self._table = _chunk_table(chunk, self._written, passes)
      self._last_digest = chunk["digest"]
      self._seq += 1
      self._iterations = _chunk_iterations(chunk, self._iterations, self._where(i))
      if "iterations" in chunk:
        self._chunk_iterations.add(chunk["iterations"])
    if self._table is None and self._fresh is not None and (
        self._fresh[0][1:] == (self._written, passes)):   # not appended since the resume
      self._table = self._fresh
    self._check_tally()
    return (*rec.runs_to_arrays(runs), passes)

  def _check_tally(self):
    """Refuses a journal that holds fewer chunks than its tally counts, or a last chunk other
    than the tally's at its count (`tally`). A tally behind the journal is a crash between
    the append and the tally's write: the journal holds more, nothing is lost.

    Raises:
      PrivacyConfigError: the journal was cut or replaced by an older copy.
    """
    if not self.tally or not os.path.exists(self.path + ".tally"):
      return
    with open(self.path + ".tally", encoding="utf-8") as f:
      tally = json.load(f)
    chunks, digest = int(tally["chunks"]), tally["digest"]
    if chunks > self._seq or (chunks == self._seq and digest != self._last_digest):
      what = (f"holds {self._seq} chunks but its tally {self.path + '.tally'!r} counts "
              f"{chunks}" if chunks > self._seq else f"ends with another chunk than its tally "
              f"{self.path + '.tally'!r} records (digest {digest[:16]}...)")
      raise PrivacyConfigError(
          f"ledger journal {self.path!r} {what}: whole "
          "chunks were cut from its end, or an older copy was put in its place, and the rounds "
          "they held would no longer be charged. Refusing to resume. Restore the complete "
          "journal; if it is lost, the run's epsilon must be computed from every round taken, "
          "not from this journal (to start a new run, remove both files). Received: "
          f"path={self.path!r}")

  def _where(self, i):
    return f"ledger journal {self.path!r} line {i + 1}"

  def _check_chain(self, chunk, i):
    where = self._where(i)
    if not isinstance(chunk, dict):
      raise ParameterValueError(f"{where} is not a ledger chunk")
    ledger_file.verify(chunk, self.key, what=where)
    if chunk.get("seq") != self._seq or chunk.get("start") != self._written or (
        chunk.get("prev") != self._last_digest):
      raise ParameterValueError(f"{where}: chunks were removed, reordered or edited (seq "
                                f"{chunk.get('seq')!r}, start {chunk.get('start')!r}; expected seq "
                                f"{self._seq}, start {self._written})")

  def check_covers(self, iterations):
    """Refuses a journal that ends before a model's `iterations` optimizer steps.

    Every step is appended before anything can save the model, so a journal whose last chunk
    records fewer iterations, or that holds fewer samples, than the restored model lost its
    tail. A journal whose chunks record iterations, none equal to `iterations`, is refused too
    (the optimizer was not restored at a step of this run). A file without chunks passes (the
    model's own ledger must then cover its iterations: `fit` checks that).

    Args:
      iterations: int, the restored model's optimizer iterations.

    Raises:
      PrivacyConfigError: the journal ends before `iterations`, or no chunk recorded
        `iterations` (the message says what to do).
    """
    iterations = int(iterations)
    if self._seq == 0:
      return
    ends = self._written if self._iterations is None else min(self._iterations, self._written)
    if ends < iterations:
      raise PrivacyConfigError(
          f"ledger journal {self.path!r} ends at {ends} steps ({self._written} samples, last "
          f"chunk at optimizer iteration {self._iterations}) but the model was restored at "
          f"iterations={iterations}: the journal lost steps the model took (its last lines "
          "were cut, or it is an older copy or another run's journal), and the steps after "
          "the last saved model may be lost with them. Refusing to train with a ledger that "
          "misses steps. Restore the complete journal file; if it is lost, the run's epsilon "
          "must be computed from its settings and every step taken (e.g. "
          "dp.accounting.compute_dp_sgd_privacy), not from this journal")
    if self._chunk_iterations and iterations not in self._chunk_iterations:
      raise PrivacyConfigError(
          f"ledger journal {self.path!r} was not written at optimizer iterations={iterations}"
          f" (its chunks record iterations {min(self._chunk_iterations)}.."
          f"{max(self._chunk_iterations)}): the optimizer resuming it was not restored at a "
          "step of this journal's run (a fresh optimizer given trained weights, or another "
          "run's), so steps missing from the journal could not be told apart. Restore the "
          "model and its optimizer from this run (BackupAndRestore, tf.train.Checkpoint, "
          "keras.models.load_model), or start a new journal for a new run")

  def resume(self, ledger, iterations=None):
    """Merges the journal into `ledger` (`PrivacyLedger.merge_arrays`: the longer of the
    two when one extends the other); returns the samples in the journal.

    Args:
      ledger: the PrivacyLedger to top up.
      iterations: optional int, the restored model's optimizer iterations: a journal that
        ends before them is refused (`check_covers`). None skips that check (e.g. when the
        model is restored later, as keras.callbacks.BackupAndRestore does; the Keras
        callback checks before the first step).

    Returns:
      int, the samples in the journal.

    Raises:
      ParameterValueError: the journal was altered (`read`).
      PrivacyConfigError: it ends before `iterations` (`check_covers`).
    """
    samples, queries, passes = self.read()
    if iterations is not None:
      self.check_covers(iterations)
    if self._table is None and self._written:   # an earlier version's journal
      # its rows become one run the ledger and the journal's next chunks name alike, so that
      # an append after a merge finds them per identity (by position it wrote other rows)
      self._fresh = self._table = run_ids.fresh(self._written, passes)
    # never loses a row the ledger holds
    ledger.merge_arrays(samples, queries, passes, self._grouping, self._table)
    held = self._table if self._table is not None or self._written else ()
    if held is not None and _growth(held, ledger.run_table()) is not None:
      self._seen = (held, self._written)   # the ledger starts with the journal's rows
    return samples.shape[0]

  def append(self, ledger, iterations=None):
    """Appends what `ledger` recorded since the last append (fsync); returns samples written.

    Args:
      ledger: the PrivacyLedger to journal.
      iterations: optional int, the optimizer's iterations now (the steps the model has
        taken), written into the chunk so a resume can tell a cut journal (`check_covers`).

    Returns:
      int, samples written by this append (0 if nothing new).
    """
    if not self._read_done and self._seq == 0 and os.path.exists(self.path):
      self.read()   # never read (a journal built to append only): continue the file's chain
    total = int(ledger.sample_count.numpy())
    passes = int(ledger.passes.numpy())
    iterations = None if iterations is None else int(iterations)
    if (total <= self._written and passes == self._passes_written and self._seq > 0
        and (iterations is None or (self._iterations or 0) >= iterations)):
      return 0
    # the check and the write under one lock: two writers that both found the file as they
    # left it cannot both append (each ledger would miss the other's steps)
    with open(self.path, "ab") as f:
      _lock_for_append(f, self.path)
      self._check_unchanged()
      samples, queries, passes, table = self._new_rows(ledger, passes)
      chunk = ledger_file.arrays_to_dict(samples, queries, passes=passes,
                                         grouping=ledger.cyclic_grouping)
      chunk.update({"seq": self._seq, "start": self._written, "prev": self._last_digest})
      if table is not None:
        chunk[TABLE_FIELD] = [list(e) for e in table]
      if iterations is not None:
        chunk["iterations"] = iterations
        self._chunk_iterations.add(iterations)
      chunk = ledger_file.sign(chunk, self.key)
      if self._torn_at is not None:   # the torn line `read` dropped, else the chunk joins it
        os.truncate(self.path, self._torn_at)
        self._size, self._torn_at = self._torn_at, None
        self._tail = self._file_tail(self._size)
      line = (json.dumps(chunk, separators=(",", ":")) + "\n").encode()
      f.write(line)
      f.flush()
      os.fsync(f.fileno())
      if self.tally:   # still under the lock: the tally of the chunk just made durable
        with files.replaced(self.path + ".tally") as tmp, open(tmp, "w", encoding="utf-8") as t:
          json.dump({"chunks": self._seq + 1, "digest": chunk["digest"]}, t)
    self._size += len(line)
    self._tail = (self._tail + line)[-_TAIL:]
    self._written += int(samples.shape[0])
    self._last_digest = chunk["digest"]
    self._seq += 1
    self._passes_written = passes
    self._table = table
    self._iterations = _chunk_iterations(chunk, self._iterations, self.path)
    return int(samples.shape[0])

  def _new_rows(self, ledger, passes):
    """(samples, queries indexed from the chunk's first sample, pass total, the journal's
    run table after them or None) of what `ledger`, with `passes` passes, holds beyond the
    journal.

    The ledger appended since the state the journal last held in its order (its run table
    extends that one's: `_growth`): its rows after that state. Else (a merge put another
    run's rows among them, or a journal that did not resume this ledger): per run identity,
    what the ledger's views hold beyond the journal's (`privacy_ledger.added_arrays`; the
    file is read again). A journal of an earlier version (no run table) that was resumed
    holds its rows under the identity `resume` drew; one never resumed appends by position.
    """
    table = ledger.run_table()
    known = self._table is not None or not self._written   # else an earlier version's
    growth = None if self._seen is None or not known else _growth(self._seen[0], table)
    if growth is not None or not known:
      start = self._seen[1] if growth is not None else self._written
      samples, queries = ledger.get_arrays(start)
      queries = queries.copy()
      queries[:, 0] -= start
      if growth is not None:
        joined = _coalesced((self._table or ()) + growth)
      else:   # an earlier version's journal: the ledger's table when it covers it
        covers = (sum(n for _, n, _ in table) == self._written + samples.shape[0]
                  and sum(p for _, _, p in table) == passes)
        joined = table if covers else None
    else:
      journal_rows = self.read()
      samples, queries, added, extra = privacy_ledger.added_arrays(
          (*journal_rows, None, self._table or ()), ledger.state())
      joined = _coalesced((self._table or ()) + extra)
      passes = self._passes_written + added
    self._seen = (table, int(ledger.sample_count.numpy()))
    return samples, queries, passes, joined

  def _check_unchanged(self):
    """Refuses to append to a file that changed since this object last read or wrote it:
    another writer appended (two servers or runs on one journal: each ledger would miss the
    other's steps, and the chains would fork), or the file was cut or replaced. The size and
    the last `_TAIL` bytes are compared (a writer that cut a torn line and appended a chunk
    as long leaves the size as it was).

    Raises:
      PrivacyConfigError: the file's size or last bytes are not the ones last read or written.
    """
    size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
    if size != self._size or self._file_tail(size) != self._tail:
      what = (f"{size} bytes, not {self._size}" if size != self._size else
              "its last bytes are not the ones it read or wrote")
      raise PrivacyConfigError(
          f"ledger journal {self.path!r} changed since this process last read or wrote it "
          f"({what}): another writer appended to it (two servers or "
          "runs on one journal: each ledger would miss the other's steps), or it was cut or "
          "replaced. Refusing to append (the step's result is not released). Run one "
          f"writer per journal, then restart on it. Received: path={self.path!r}")

  def _file_tail(self, size):
    """The last `_TAIL` bytes (at most) of the file's first `size` bytes (b"" for none)."""
    if not size:
      return b""
    with open(self.path, "rb") as f:
      f.seek(max(size - _TAIL, 0))
      return f.read(min(size, _TAIL))


def _lock_for_append(f, path):
  """Takes the exclusive lock (flock, released when `f` closes) of the journal file `f` that
  an append holds from its check of the file to its fsync (none on a file system without
  flock: the size and tail check alone then).

  Raises:
    PrivacyConfigError: another writer holds it (two runs or servers appending to one
      journal at the same instant).
  """
  try:
    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno in files.NO_FLOCK_ERRNOS:   # a file system without flock: the size check alone, as before
      return
    if not isinstance(e, BlockingIOError):
      raise
    raise PrivacyConfigError(
        f"ledger journal {path!r} is being appended to by another writer (two runs or "
        "servers on one journal: each ledger would miss the other's steps). Refusing to "
        "append (the step's result is not released). Run one writer per journal, then "
        f"restart on it. Received: path={path!r}") from e


def _chunk_table(chunk, samples, passes):
  """The run table a chunk records for the journal's first `samples` samples and `passes`
  passes, or None (none recorded, or one that does not cover them: the journal is then a run
  of its own, the safe side)."""
  if TABLE_FIELD not in chunk:
    return None
  try:
    return run_ids.check_table(chunk[TABLE_FIELD], samples, passes)
  except ParameterValueError:
    return None


def _growth(seen, table):
  """The segments run table `table` adds by position after `seen` (it starts with seen's
  segments, the last of them possibly longer: the ledger only appended), or None."""
  seen = tuple(seen)
  k = len(seen)
  if len(table) < k or tuple(table[:k - 1]) != seen[:k - 1]:
    return None
  if not k:
    return tuple(table)
  (rid, n, p), (rid2, n2, p2) = seen[-1], table[k - 1]
  if rid != rid2 or n2 < n or p2 < p or (rid is None and (n2, p2) != (n, p)):
    return None
  return ((rid, n2 - n, p2 - p),) + tuple(table[k:])


def _coalesced(table):
  """`table` without segments of no sample and no pass, adjacent segments of one identity
  joined (a segment without identity stays apart)."""
  out = []
  for rid, n, p in table:
    if not (n or p):
      continue
    if out and rid is not None and out[-1][0] == rid:
      out[-1] = (rid, out[-1][1] + n, out[-1][2] + p)
    else:
      out.append((rid, n, p))
  return tuple(out)


def _chunk_iterations(chunk, previous, where):
  """The optimizer iterations a chunk records (else `previous`); ValueError if malformed."""
  if "iterations" not in chunk:
    return previous
  it = chunk["iterations"]
  if not isinstance(it, int) or isinstance(it, bool) or it < 0:
    raise ParameterValueError(f"{where}: 'iterations' must be an integer >= 0, got {it!r}")
  return it if previous is None else max(previous, it)

