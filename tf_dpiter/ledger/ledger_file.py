"""The ledger's JSON file: versioned, run-length coded, digest-protected (pure Python).

A file is {"format", "version": 2, "num_samples", "passes", "runs": [...], "digest"} with,
optionally, "hmac": "sha256:" + the SHA-256 of the canonical JSON (sorted keys, no spaces) of
everything but "digest" and "hmac", and "hmac-sha256:" + HMAC-SHA256 of the same bytes under
a user's key. Reading refuses a missing or wrong digest, a wrong or missing HMAC when a key is
given, and version-1 files (no relation, unit or passes: their epsilon may be too small). A
ledger with a private selection is version 3 (a "selection" field), which older readers
refuse. An optional "cyclic_grouping" field (signed like the rest) is the record of the
grouping of the cyclic Poisson run the ledger charges (`PrivacyLedger.cyclic_grouping`):
"sha256:" + 64 hex digits, or "conflict".

The digest detects accidental changes, NOT forgery (anyone can recompute it; `privacy_report`
says so in its assumptions); only the HMAC, checked with the writer's key, refuses a forged
file.
"""

import hashlib
import hmac as hmac_lib
import json
import re

import numpy as np

from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import records as rec
from tf_dpiter.ledger import run_ids
from tf_dpiter.ledger import selection as selection_lib

_SIGNATURE_FIELDS = ("digest", "hmac")


def _canonical(d):
  body = {k: v for k, v in d.items() if k not in _SIGNATURE_FIELDS}
  try:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
  except ValueError:
    raise ParameterValueError("ledger has a non-finite number (NaN or infinity) in a field") from None


def _mac(key, body):
  """"hmac-sha256:" + the HMAC-SHA256 of `body` under `key` (a non-empty str or bytes)."""
  if isinstance(key, str):
    key = key.encode()
  if not isinstance(key, (bytes, bytearray)) or not key:
    raise ParameterValueError(f"key must be a non-empty str or bytes, got {type(key).__name__}")
  return "hmac-sha256:" + hmac_lib.new(bytes(key), body, hashlib.sha256).hexdigest()


def sign(d, key=None):
  """A new dict: JSON-able `d` (any signature fields dropped) plus "digest" ("sha256:...")
  and, with `key`, "hmac" ("hmac-sha256:..."). Without a key the SHA-256 digest detects
  accidental changes, not forgery (anyone can recompute it): give a key for that."""
  out = {k: v for k, v in d.items() if k not in _SIGNATURE_FIELDS}
  body = _canonical(out)
  out["digest"] = "sha256:" + hashlib.sha256(body).hexdigest()
  if key is not None:
    out["hmac"] = _mac(key, body)
  return out


def verify(d, key=None, what="ledger"):
  """Raises unless the signed dict `d`'s digest (and, with `key`, its HMAC) matches its
  content; `what` names `d` in the messages.

  Raises:
    ParameterValueError: if the digest does not match, or with `key`, the HMAC is missing or
      wrong. Without `key` a forged dict whose digest was recomputed passes: a digest is no MAC.
  """
  body = _canonical(d)
  expected = "sha256:" + hashlib.sha256(body).hexdigest()
  if d.get("digest") != expected:
    raise ParameterValueError(f"{what} was altered or is incomplete: its 'digest' is {d.get('digest')!r}, "
                              f"its content hashes to {expected!r}; refusing to account it")
  if key is not None:
    mac = _mac(key, body)
    if "hmac" not in d:
      raise ParameterValueError(f"{what} has no 'hmac' but a key was given: it was not written with this key")
    if not hmac_lib.compare_digest(str(d["hmac"]), mac):
      raise ParameterValueError(f"{what} HMAC does not match under the given key: altered, or another key")


# Query kinds in the file: kind code -> ("type", name of the clip field, name of the noise
# field). Gaussian-noise kinds, correlated ones included, keep (clip, stddev,
# sensitivity); the structure a correlated row needs (bands, tree depth, min separation) is in
# its sensitivity and in its sample's policy and sample_size (see `records`).
_QUERY_FIELDS = {
    rec.GAUSSIAN: ("gaussian", "l2_norm_clip", "stddev"),
    rec.LAPLACE: ("laplace", "l1_norm_clip", "scale"),
    rec.BANDED_GAUSSIAN: ("banded_gaussian", "l2_norm_clip", "stddev"),
    rec.TREE_GAUSSIAN: ("tree_gaussian", "l2_norm_clip", "stddev"),
    rec.MATRIX_GAUSSIAN: ("matrix_gaussian", "l2_norm_clip", "stddev"),
}
_KIND_OF_TYPE = {t: kind for kind, (t, _, _) in _QUERY_FIELDS.items()}
_NON_PRIVATE_TYPE = "non_private"


def _query_dict(row):
  """The file form of one query row [sample_index, kind, clip, noise, sensitivity]."""
  kind = int(row[1])
  if kind == rec.NON_PRIVATE:
    return {"type": _NON_PRIVATE_TYPE}
  if kind not in _QUERY_FIELDS:
    raise ParameterValueError(f"query kind {kind} has no file form; known kinds: "
                              f"{sorted(_QUERY_FIELDS) + [rec.NON_PRIVATE]}")
  t, clip_name, noise_name = _QUERY_FIELDS[kind]
  return {"type": t, clip_name: float(row[2]), noise_name: float(row[3]),
          "sensitivity": float(row[4])}


GROUPING_FIELD = "cyclic_grouping"
_GROUPING = re.compile(r"(sha256:[0-9a-f]{64}|conflict)\Z")


def check_grouping(grouping, where="ledger"):
  """`grouping` (a cyclic grouping record, or None) if well formed.

  Raises:
    ParameterValueError: not None, "conflict" or "sha256:" + 64 lowercase hex digits.
  """
  if grouping is not None and not (isinstance(grouping, str) and _GROUPING.match(grouping)):
    raise ParameterValueError(f"{where} field {GROUPING_FIELD!r} must be 'sha256:' + 64 hex "
                              f"digits or 'conflict'. Received: {GROUPING_FIELD}={grouping!r}")
  return grouping


def arrays_to_dict(samples, queries, passes=0, key=None, grouping=None, runs=None):
  """The signed (`sign`), run-length coded JSON-able dict (`runs_to_dict`) of a ledger's
  sample and query arrays, pass count, cyclic grouping record (None: no field) and run table
  (`run_ids`: its "run_ids" field, [[id, samples, passes], ...] covering the samples in
  order; None: no field)."""
  samples, queries = rec.validate_arrays(samples, queries)
  d = runs_to_dict(rec.run_length_encode(samples, queries), passes, None, grouping)
  if runs is None:
    return sign(d, key) if key is not None else d
  table = run_ids.check_table(runs, samples.shape[0], passes)
  d[run_ids.FIELD] = [list(entry) for entry in table]
  return sign(d, key)


def runs_to_dict(runs, passes=0, key=None, grouping=None):
  """The signed JSON-able dict of runs [(count, sample_row, query_rows)] (counts kept as
  counts) and `passes` (shuffled passes / epochs started), HMAC'd with the optional `key`
  (str or bytes). A selection marker among the runs (`selection`) becomes the file's
  "selection" field and the file version 3; a ledger without one stays version 2.

  Raises:
    ParameterValueError: a run fails the checks of `records.validate_arrays`.
  """
  runs, selected = selection_lib.split_runs(runs)
  out = []
  for count, s, qs in runs:
    s = np.asarray(s, np.float64)
    qs = np.array(qs, np.float64).reshape(-1, len(rec.QUERY_COLUMNS))
    qs[:, 0] = 0.0                  # rows of one sample (run_length_encode keeps the index)
    rec.validate_arrays(s[None], qs)
    policy = rec.policy_name(s[3])
    out.append({"count": int(count), "policy": policy,
                "relation": rec.relation_for_policy(policy), "population_size": float(s[0]),
                "selection_probability": float(s[1]), "sample_size": float(s[2]),
                "examples_per_record": int(s[4]), "queries": [_query_dict(row) for row in qs]})
  d = {"format": rec.FORMAT_NAME, "version": rec.FORMAT_VERSION,
       "num_samples": sum(r["count"] for r in out), "passes": int(passes), "runs": out}
  if selected is not None:
    d["version"] = selection_lib.SELECTION_VERSION
    d["selection"] = selection_lib.to_field(selected)
  if check_grouping(grouping) is not None:
    d[GROUPING_FIELD] = grouping
  return sign(d, key)


def _query_row(q):
  """Inverse of `_query_dict`: [0, kind, clip, noise, sensitivity]."""
  t = q["type"]
  if t == _NON_PRIVATE_TYPE:
    return [0.0, rec.NON_PRIVATE, 0.0, 0.0, 0.0]
  if t not in _KIND_OF_TYPE:
    raise ParameterValueError(f"query 'type' must be one of {sorted(_KIND_OF_TYPE) + [_NON_PRIVATE_TYPE]}"
                              f", got {t!r}")
  kind = _KIND_OF_TYPE[t]
  _, clip_name, noise_name = _QUERY_FIELDS[kind]
  return [0.0, float(kind), float(q[clip_name]), float(q[noise_name]), float(q["sensitivity"])]


def _parse_run(r):
  count = r["count"]
  if not isinstance(count, int) or isinstance(count, bool) or count < 1:
    raise ParameterValueError(f"'count' must be a positive integer, got {count!r}")
  policy = r["policy"]
  pol = rec.policy_code(policy)
  if r["relation"] != rec.relation_for_policy(policy):
    raise PrivacyConfigError(f"'relation' must be {rec.relation_for_policy(policy)!r} for policy "
                             f"{policy!r}, got {r['relation']!r}")
  qs = [_query_row(q) for q in r["queries"]]
  row = [float(r["population_size"]), float(r["selection_probability"]),
         float(r["sample_size"]), float(pol), float(r["examples_per_record"]), float(len(qs))]
  s_arr, q_arr = rec.validate_arrays(np.asarray([row]), np.asarray(qs).reshape(-1, 5))
  return count, s_arr[0], q_arr


def _check_header(d):
  if not isinstance(d, dict) or d.get("format") != rec.FORMAT_NAME:
    raise ParameterValueError(f"not a tf_dpiter ledger: field 'format' must be {rec.FORMAT_NAME!r}, "
                              f"got {d.get('format') if isinstance(d, dict) else type(d).__name__!r}")
  if d.get("version") == 1:
    raise PrivacyConfigError("ledger version 1 did not record the neighbouring relation, the "
                             "microbatch unit or the shuffled passes, so its epsilon can be too small; "
                             "it is refused. Account that run again from its settings with "
                             "compute_dp_sgd_privacy(..., sampling=..., num_microbatches=...)")
  version = d.get("version")
  if version not in (rec.FORMAT_VERSION, selection_lib.SELECTION_VERSION):
    raise PrivacyConfigError(f"unsupported ledger version {version!r}; this tf_dpiter reads versions "
                             f"{rec.FORMAT_VERSION} and {selection_lib.SELECTION_VERSION} (with a "
                             "private selection)")
  if (version == selection_lib.SELECTION_VERSION) != ("selection" in d):
    raise PrivacyConfigError(f"ledger version {version} {'needs' if 'selection' not in d else 'cannot hold'}"
                             f" a 'selection' field: version {selection_lib.SELECTION_VERSION} is the "
                             "version of ledgers that record a private selection")


def dict_to_runs(d, key=None):
  """([(count, sample_row, query_rows)], passes) of a ledger dict, parsed, verified (with the
  HMAC `key` it was signed with, or None) and validated. Counts stay counts: a run of 10^6
  identical samples is one row. A "selection" field (version 3) comes back as its marker run
  (`selection`) after the trial's samples.

  Raises:
    ParameterValueError: a bad header, digest or HMAC, or a malformed or invalid run or
      selection.
  """
  _check_header(d)
  verify(d, key)
  runs = d.get("runs")
  if not isinstance(runs, list):
    raise ParameterValueError(f"ledger field 'runs' must be a list, got {type(runs).__name__}")
  out = []
  for i, r in enumerate(runs):
    try:
      out.append(_parse_run(r))
    except (KeyError, TypeError, AttributeError) as e:
      raise ParameterValueError(f"ledger run {i} is malformed: missing or bad field {e}") from None
    except ValueError as e:
      raise ParameterValueError(f"ledger run {i}: {e}") from None
  total = int(sum(c for c, _, _ in out))
  if d.get("num_samples") != total:
    raise PrivacyConfigError(f"inconsistent ledger: 'num_samples' is {d.get('num_samples')!r} but the "
                             f"runs hold {total} samples")
  passes = d.get("passes")
  if not isinstance(passes, int) or isinstance(passes, bool) or passes < 0:
    raise ParameterValueError(f"ledger field 'passes' must be an integer >= 0, got {passes!r}")
  if "selection" in d:
    out = selection_lib.insert_marker(out, selection_lib.from_field(d["selection"]))
  return out, passes


def dict_to_arrays(d, key=None):
  """(samples, queries, passes), the two numpy arrays and the int pass count, of a ledger
  dict written by `arrays_to_dict`, verified (optional HMAC `key`) and validated."""
  runs, passes = dict_to_runs(d, key)
  samples, queries = rec.runs_to_arrays(runs)
  return samples, queries, passes


def dict_to_state(d, key=None):
  """(samples, queries, passes, grouping, run table) of a ledger dict: `dict_to_arrays`, its
  cyclic grouping record (None when the dict has none) and its run table ("run_ids"; a dict
  of an earlier version has none: its samples are read as one run under a new identity,
  `run_ids.fresh`), verified and validated."""
  samples, queries, passes = dict_to_arrays(d, key)
  if run_ids.FIELD in d:
    table = run_ids.check_table(d[run_ids.FIELD], samples.shape[0], passes)
  else:
    table = run_ids.fresh(samples.shape[0], passes)
  return samples, queries, passes, check_grouping(d.get(GROUPING_FIELD)), table


def loads(text, key=None, with_grouping=False):
  """(samples, queries, passes) of a ledger JSON string, as `dict_to_arrays` (with
  `with_grouping`, and its grouping record: `dict_to_state`).

  Raises:
    ParameterValueError: if the JSON cannot be parsed, or the ledger is malformed or fails
      verification.
  """
  try:
    d = json.loads(text)
  except (json.JSONDecodeError, TypeError) as e:
    raise ParameterValueError(f"ledger JSON could not be parsed: {e}") from None
  return dict_to_state(d, key) if with_grouping else dict_to_arrays(d, key)


def load(path, key=None, with_grouping=False):
  """(samples, queries, passes) of a ledger JSON file, as `loads`; errors name the file.

  Raises:
    ParameterValueError: if the file cannot be read, or its content is malformed or fails
      verification.
  """
  try:
    with open(path) as f:
      text = f.read()
  except OSError as e:
    raise ParameterValueError(f"ledger file {path!r} could not be read: {e}") from None
  try:
    return loads(text, key, with_grouping)
  except ValueError as e:
    raise ParameterValueError(f"ledger file {path!r}: {e}") from None
