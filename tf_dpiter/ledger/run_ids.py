"""Run identities of a privacy ledger's samples: which run wrote each one (pure Python).

Rule: every noised step that touched the released weights is charged once (McMahan et al.
2018, "A General Approach to Adding Differential Privacy to Iterative Training Procedures",
Section 6). Merging two ledgers (a restore, a weights file, a nested DP model, a layer's
earlier DP training) must therefore tell "the same steps seen twice" from "two runs with equal
settings", whose sample rows are equal. Rows cannot tell them apart; an identity can.

Every `PrivacyLedger` object draws its own identity, 128 bits from the OS entropy source
(`secrets.token_hex`), when it is created: the samples it records belong to that run. A ledger
holds a *run table*, the segments of its samples in order, each (id, samples, passes), so a
ledger that adopted other runs' samples still names whose they are. The table travels with
the rows (checkpoint, signed dict / JSON file, weights-file entry, optimizer config, journal).

Merge (`merge_tables`), the rule: one run is one identity. The samples of one identity are
written by one ledger object, which only appends, so of two views of one identity (the live
ledger, its journal, a checkpoint, a file saved at some step) one is a prefix of the other:
merging them keeps their union, the longer (passes: the larger), never their sum. Two views
of one identity that differ at a sample both hold are refused (`PrivacyConfigError`): one was
altered, and neither their sum nor either one is the run's ledger. Different identities are
different runs, even with equal rows: both are charged (passes added). A segment without
identity (None: a ledger of an earlier version, or arrays given without a table) is another
run, never merged with anything: charging more is the safe side. `additions` is the same
merge seen from a copy that keeps its rows in place (a journal appending by position). The
relation and unit are those of each sample row (`records`); nothing here changes them.
"""

import json
import re
import secrets

import numpy as np

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError

FIELD = "run_ids"   # the signed ledger dict's field: [[id or null, samples, passes], ...]
_ID = re.compile(r"[0-9a-f]{32}\Z")


def new_id():
  """A fresh run identity: 128 bits from the OS entropy source, as 32 lowercase hex digits."""
  return secrets.token_hex(16)


def check_table(table, num_samples, passes, where="ledger"):
  """The run table `table` as a tuple of (id or None, samples, passes), if well formed and
  covering `num_samples` samples and `passes` passes.

  Args:
    table: a sequence of [id, samples, passes] (id: 32 lowercase hex digits or None).
    num_samples: the ledger's sample rows.
    passes: the ledger's pass count.
    where: names the source in the messages.

  Returns:
    tuple of (str or None, int, int).

  Raises:
    ParameterValueError: a malformed entry, or counts that do not add up.
  """
  out = []
  if not isinstance(table, (list, tuple)):
    raise ParameterValueError(f"{where} field {FIELD!r} must be a list of [id, samples, "
                              f"passes]. Received: {FIELD}={table!r}")
  for entry in table:
    ok = isinstance(entry, (list, tuple)) and len(entry) == 3
    if ok:
      rid, n, p = entry
      ok = ((rid is None or (isinstance(rid, str) and _ID.match(rid)))
            and all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c >= 0
                    for c in (n, p)))
    if not ok:
      raise ParameterValueError(
          f"{where} field {FIELD!r} must hold [id, samples, passes] entries (id: 32 lowercase "
          f"hex digits or null; counts: integers >= 0). Received: entry={entry!r}")
    out.append((rid, int(n), int(p)))
  if sum(n for _, n, _ in out) != int(num_samples) or sum(p for _, _, p in out) != int(passes):
    raise ParameterValueError(
        f"{where} field {FIELD!r} must cover the ledger's {int(num_samples)} samples and "
        f"{int(passes)} passes. Received: {FIELD}={[list(e) for e in out]!r}")
  return tuple(out)


def unknown(num_samples, passes):
  """The table of rows whose run is not known (an earlier version's ledger): one segment
  without identity, never merged with another."""
  return ((None, int(num_samples), int(passes)),)


def fresh(num_samples, passes):
  """The table of rows read from a source without identities (an earlier version's file):
  one segment under a new identity, so that merging this copy again charges it once, while
  another reading of the source is another run (the safe side)."""
  return ((new_id(), int(num_samples), int(passes)),)


# The stored form (a string variable of the ledger): the segments before the ledger's own
# trailing segment, and its own identity; the trailing segment's counts are what the rows and
# passes hold beyond the listed ones, so a write inside tf.function needs no table update.

def encode(segments, own):
  """The stored form of `segments` (explicit, before the trailing one) and `own`."""
  return json.dumps({"segments": [list(s) for s in segments], "own": own},
                    separators=(",", ":"))


def decode(text):
  """(segments, own) of a stored form."""
  d = json.loads(text)
  return tuple((s[0], int(s[1]), int(s[2])) for s in d["segments"]), d["own"]


def explicit(text, num_samples, passes):
  """The full table of a stored form for a ledger of `num_samples` samples and `passes`."""
  segments, own = decode(text)
  rest_n = int(num_samples) - sum(n for _, n, _ in segments)
  rest_p = int(passes) - sum(p for _, _, p in segments)
  return segments + ((own, max(rest_n, 0), max(rest_p, 0)),)


def stored(table, own):
  """The stored form of a full `table` written to a ledger whose own identity is `own`: its
  last segment becomes the trailing one when it is `own`'s, else `own` starts an empty one."""
  table = tuple(table)
  if table and table[-1][0] == own:
    table = table[:-1]
  return encode(table, own)


def _blocks(samples, queries, table):
  """{key: (id, samples, queries re-indexed from 0, passes)} of a ledger's identities in order
  of first appearance (one identity's segments concatenated: one object appended them); a
  segment without identity gets a key of its own."""
  out, start = {}, 0
  for rid, n, p in table:
    sel = (queries[:, 0] >= start) & (queries[:, 0] < start + n)
    q = queries[sel].copy()
    q[:, 0] -= start
    key = rid if rid is not None else object()
    block = (samples[start:start + n], q, p)
    out[key] = (rid, _concat(out[key][1], block) if key in out else block)
    start += n
  return out


def _concat(a, b):
  """Block b appended to block a (b's query indices shifted)."""
  (sa, qa, pa), (sb, qb, pb) = a, b
  qb = qb.copy()
  qb[:, 0] += sa.shape[0]
  return np.concatenate([sa, sb]), np.concatenate([qa, qb]), pa + pb


def merge_tables(current, restored, common_prefix):
  """The ledger charging every step of two ledgers once: (samples, queries, passes, table).

  Args:
    current: (samples, queries, passes, table) of the ledger merged into.
    restored: (samples, queries, passes, table) of the ledger merged in.
    common_prefix: f((s1, q1), (s2, q2)) -> leading samples two row sets share.

  Returns:
    (samples, queries, passes, table): per identity, the longer of the two views (one is a
    prefix of the other; passes: the larger); different identities and segments without
    one are all kept. Restored identities come first, in order.

  Raises:
    PrivacyConfigError: two views of one identity differ at a sample both hold.
  """
  merged = _blocks(*restored[:2], restored[3])
  for key, (rid, view) in _blocks(*current[:2], current[3]).items():
    merged[key] = (rid, _merge_views(merged[key][1], view, common_prefix, rid)
                   if key in merged else view)
  return _joined(merged.values(), current[0].shape[1], current[1].shape[1])


def _merge_views(restored, current, common_prefix, rid):
  """Two views (samples, queries, passes) of identity `rid`: their union, the current view
  followed by what the restored one holds beyond it (`_extension`)."""
  return _concat(current, _extension(current, restored, common_prefix, rid))


def _extension(current, restored, common_prefix, rid):
  """(samples, queries re-indexed from 0, passes) of what the view `restored` of identity
  `rid` holds beyond the view `current`: nothing when restored is a prefix of current, its
  samples after current's when current is a prefix of it (passes: the excess).

  Raises:
    PrivacyConfigError: the two views differ at a sample both hold.
  """
  (sc, qc, pc), (sr, qr, pr) = current, restored
  p = common_prefix((sc, qc), (sr, qr))
  if p < min(sc.shape[0], sr.shape[0]):
    raise PrivacyConfigError(
        f"two views of the ledger of run {rid} disagree at its sample {p} (of "
        f"{sc.shape[0]} and {sr.shape[0]}): one run's ledger only appends, so one of them was "
        "altered or belongs to another run under a copied identity. Neither their sum nor "
        "either view is the run's ledger; refusing to merge them. Merge the run's own ledger "
        f"(its journal, checkpoint or saved file) instead. Received: run_id={rid!r}")
  tail_q = qr[qr[:, 0] >= p].copy()
  tail_q[:, 0] -= p
  return sr[p:], tail_q, max(pr - pc, 0)


def additions(current, restored, common_prefix):
  """What a ledger `restored` holds beyond a ledger `current`, per identity, in restored's
  order: (samples, queries re-indexed from 0, passes, table). Appended to current's rows,
  this is the merge of the two that keeps current's rows in place (a journal continuing
  by position: `journal.LedgerJournal.append`).

  Args:
    current: (samples, queries, passes, table) of the ledger appended to.
    restored: (samples, queries, passes, table) of the ledger whose additions are taken.
    common_prefix: f((s1, q1), (s2, q2)) -> leading samples two row sets share.

  Returns:
    (samples, queries, passes, table) of the additions (segments of identities current
    does not hold, segments without identity, and the extensions of its views).

  Raises:
    PrivacyConfigError: two views of one identity differ at a sample both hold.
  """
  held = _blocks(*current[:2], current[3])
  width_q = current[1].shape[1]
  empty = (current[0][:0], np.zeros((0, width_q)), 0)
  extra = {key: (rid, _extension(held[key][1] if key in held else empty, view,
                                 common_prefix, rid))
           for key, (rid, view) in _blocks(*restored[:2], restored[3]).items()}
  return _joined(extra.values(), current[0].shape[1], width_q)


def earlier(state, snapshot):
  """A ledger as it was when its run table was `snapshot`: (samples, queries, passes,
  table), each identity's first samples and passes as the snapshot counts them (a run's view
  only grows, so its first samples are those it held then), or None when the snapshot has a
  segment without identity (not found again: the whole ledger is the safe side).

  Args:
    state: (samples, queries, passes, table) of the ledger now.
    snapshot: its run table at the earlier time.
  """
  if any(rid is None for rid, _, _ in snapshot):
    return None
  now = _blocks(*state[:2], state[3])
  counts = {}
  for rid, n, p in snapshot:
    n0, p0 = counts.get(rid, (0, 0))
    counts[rid] = (n0 + n, p0 + p)
  blocks = []
  for rid, (n, p) in counts.items():
    s, q, _ = now[rid][1] if rid in now else (state[0][:0], state[1][:0], 0)
    blocks.append((rid, (s[:n], q[q[:, 0] < n], p)))
  return _joined(blocks, state[0].shape[1], state[1].shape[1])


def _joined(blocks, width_s, width_q):
  """(samples, queries, passes, table) of (id, (samples, queries, passes)) blocks in order;
  a block with no sample and no pass is dropped (it charges nothing)."""
  samples, queries, passes, table = [], [], 0, []
  offset = 0
  for rid, (s, q, p) in blocks:
    if s.shape[0] == 0 and p == 0:
      continue
    q = q.copy()
    q[:, 0] += offset
    samples.append(s)
    queries.append(q)
    passes += p
    table.append((rid, int(s.shape[0]), int(p)))
    offset += s.shape[0]
  return (np.concatenate(samples) if samples else np.zeros((0, width_s)),
          np.concatenate(queries) if queries else np.zeros((0, width_q)),
          passes, tuple(table))
