"""The privacy ledger (seed 002, Section 6), held in TF variables.

It records *sampling events* (population size n, selection probability q, sample size,
sampling policy) and, for each, the *sum query events* of that sample: Gaussian (S_g,
sigma~_g), Laplace (C, b) or non-private. Writes work inside `tf.function`; buffers double
when full, so no event is ever dropped or truncated. The ledger is a `tf.Module`:
`tf.train.Checkpoint` saves and restores it, and a restored run continues its accounting.
The accountant reads it afterwards (`tf_dpiter.accounting`).
"""

import json

import numpy as np
import tensorflow as tf

from tf_dpiter.dp_query import events as events_lib

FORMAT_NAME = "tf_dpiter.privacy_ledger"
FORMAT_VERSION = 1

# Sampling policies (seed 002, Section 5).
POISSON = "poisson"            # each record joins each sample independently with probability q
FIXED_SIZE = "fixed_size"      # samples of `sample_size` records, drawn without replacement, independent
SHUFFLE = "shuffle"            # shuffled epochs: disjoint batches of `sample_size` (no amplification claimed)
FULL = "full"                  # every record in every sample (q = 1)
POLICIES = (POISSON, FIXED_SIZE, SHUFFLE, FULL)
_POLICY_CODE = {p: i for i, p in enumerate(POLICIES)}

# Query kinds in the query buffer.
GAUSSIAN, LAPLACE, NON_PRIVATE = 0, 1, 2
_KIND_NAME = {GAUSSIAN: "gaussian", LAPLACE: "laplace", NON_PRIVATE: "non_private"}
_KIND_CODE = {v: k for k, v in _KIND_NAME.items()}

# Columns of the two buffers.
SAMPLE_COLUMNS = ("population_size", "selection_probability", "sample_size", "policy", "num_queries")
QUERY_COLUMNS = ("sample_index", "kind", "sensitivity", "noise")


def policy_code(policy):
  if policy not in _POLICY_CODE:
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
  return _POLICY_CODE[policy]


def policy_name(code):
  return POLICIES[int(code)]


def _f64(x):
  """float64 tensor; Python floats are converted at full precision (tf.cast would go via float32)."""
  return tf.cast(tf.convert_to_tensor(x, dtype_hint=tf.float64), tf.float64)


def _event_row(event):
  """(kind, sensitivity, noise) of one privacy event, as float64 tensors."""
  f = _f64
  if isinstance(event, events_lib.GaussianSumEvent):
    return [f(GAUSSIAN), f(event.l2_norm_clip), f(event.stddev)]
  if isinstance(event, events_lib.LaplaceSumEvent):
    return [f(LAPLACE), f(event.l1_norm_clip), f(event.scale)]
  if isinstance(event, events_lib.NonPrivateEvent):
    return [f(NON_PRIVATE), f(0.0), f(0.0)]
  raise ValueError(f"events must be GaussianSumEvent, LaplaceSumEvent or NonPrivateEvent, got {event!r}")


class PrivacyLedger(tf.Module):
  """Growable record of sampling and sum-query events, in TF variables."""

  def __init__(self, initial_capacity=1024, name="privacy_ledger"):
    super().__init__(name=name)
    cap = int(initial_capacity)
    if cap < 1:
      raise ValueError(f"initial_capacity must be >= 1, got {initial_capacity!r}")
    with tf.name_scope(name):
      self._samples = tf.Variable(tf.zeros([cap, len(SAMPLE_COLUMNS)], tf.float64),
                                  shape=tf.TensorShape([None, len(SAMPLE_COLUMNS)]),
                                  trainable=False, name="samples")
      self._queries = tf.Variable(tf.zeros([cap, len(QUERY_COLUMNS)], tf.float64),
                                  shape=tf.TensorShape([None, len(QUERY_COLUMNS)]),
                                  trainable=False, name="queries")
      self._sample_count = tf.Variable(0, dtype=tf.int64, trainable=False, name="sample_count")
      self._query_count = tf.Variable(0, dtype=tf.int64, trainable=False, name="query_count")

  @property
  def sample_count(self):
    return self._sample_count.read_value()

  @property
  def query_count(self):
    return self._query_count.read_value()

  @staticmethod
  def _ensure_capacity(buffer, needed):
    """Doubles `buffer` (at least to `needed` rows) when it is too small."""
    # VariableShape reads the shape without copying the buffer (tf.shape would read it all).
    cap = tf.raw_ops.VariableShape(input=buffer.handle, out_type=tf.int64)[0]

    def _grow():
      new_cap = tf.maximum(2 * cap, needed)
      pad = tf.zeros(tf.stack([new_cap - cap, tf.constant(buffer.shape[1], tf.int64)]), tf.float64)
      buffer.assign(tf.concat([buffer.read_value(), pad], axis=0))
      return tf.constant(True)

    return tf.cond(needed > cap, _grow, lambda: tf.constant(False))

  def record_sample(self, population_size, selection_probability, events,
                    policy=POISSON, sample_size=0):
    """Records one sample (sampling event) and its sum query events.

    Works eagerly and inside `tf.function` (not under XLA: the buffers grow).
    `population_size` n, `selection_probability` q and `sample_size` may be tensors; `events`
    is the tuple returned by `DPQuery.get_noised_result`; `policy` one of POLICIES.
    """
    code = policy_code(policy)
    events = tuple(events)
    rows = [_event_row(e) for e in events]
    f = _f64
    idx = self._sample_count.read_value()
    qidx = self._query_count.read_value()
    grew = [self._ensure_capacity(self._samples, idx + 1)]
    if rows:
      grew.append(self._ensure_capacity(self._queries, qidx + len(rows)))
    with tf.control_dependencies(grew):
      srow = tf.stack([f(population_size), f(selection_probability), f(sample_size),
                       f(code), f(len(rows))])
      ops = [self._samples.scatter_nd_update(tf.reshape(idx, [1, 1]), srow[tf.newaxis])]
      if rows:
        qrows = tf.stack([tf.stack([f(idx)] + r) for r in rows])
        qind = tf.reshape(qidx + tf.range(len(rows), dtype=tf.int64), [-1, 1])
        ops.append(self._queries.scatter_nd_update(qind, qrows))
    with tf.control_dependencies(ops):
      new_count = self._sample_count.assign_add(1)
      self._query_count.assign_add(len(rows))
    return new_count

  # ---- reading and (de)serialization ---------------------------------------------------

  def get_arrays(self):
    """(samples [N, 5], queries [Q, 4]) as float64 numpy arrays, trimmed to what was recorded."""
    n = int(self._sample_count.numpy())
    q = int(self._query_count.numpy())
    return self._samples.numpy()[:n].copy(), self._queries.numpy()[:q].copy()

  def set_arrays(self, samples, queries):
    """Replaces the content by validated arrays (used by import)."""
    samples, queries = validate_arrays(samples, queries)
    cap_s = max(1, samples.shape[0])
    cap_q = max(1, queries.shape[0])
    s = np.zeros([cap_s, len(SAMPLE_COLUMNS)]); s[:samples.shape[0]] = samples
    q = np.zeros([cap_q, len(QUERY_COLUMNS)]); q[:queries.shape[0]] = queries
    self._samples.assign(s)
    self._queries.assign(q)
    self._sample_count.assign(samples.shape[0])
    self._query_count.assign(queries.shape[0])

  def to_dict(self):
    return arrays_to_dict(*self.get_arrays())

  def to_json(self):
    return json.dumps(self.to_dict())

  def save_json(self, path):
    with open(path, "w") as f:
      f.write(self.to_json())

  @classmethod
  def from_dict(cls, d):
    samples, queries = dict_to_arrays(d)
    ledger = cls(initial_capacity=max(1, samples.shape[0]))
    ledger.set_arrays(samples, queries)
    return ledger

  @classmethod
  def from_json(cls, text):
    try:
      d = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
      raise ValueError(f"ledger JSON could not be parsed: {e}") from None
    return cls.from_dict(d)

  @classmethod
  def load_json(cls, path):
    try:
      with open(path) as f:
        text = f.read()
    except OSError as e:
      raise ValueError(f"ledger file {path!r} could not be read: {e}") from None
    try:
      return cls.from_json(text)
    except ValueError as e:
      raise ValueError(f"ledger file {path!r}: {e}") from None


def validate_arrays(samples, queries):
  """Checks ledger arrays for consistency; raises ValueError naming the bad field."""
  samples = np.asarray(samples, dtype=np.float64).reshape(-1, len(SAMPLE_COLUMNS))
  queries = np.asarray(queries, dtype=np.float64).reshape(-1, len(QUERY_COLUMNS))
  if not np.all(np.isfinite(samples)):
    i = int(np.argwhere(~np.isfinite(samples))[0][0])
    raise ValueError(f"sample {i} has a non-finite field: {samples[i].tolist()}")
  n, q, m, pol, nq = samples.T if samples.size else [np.zeros(0)] * 5
  bad = np.flatnonzero(n <= 0)
  if bad.size:
    raise ValueError(f"population_size must be > 0, got {n[bad[0]]!r} at sample {bad[0]}")
  bad = np.flatnonzero(~((q > 0) & (q <= 1)))
  if bad.size:
    raise ValueError(f"selection_probability must be in (0, 1], got {q[bad[0]]!r} at sample {bad[0]}")
  bad = np.flatnonzero(~np.isin(pol, np.arange(len(POLICIES))))
  if bad.size:
    raise ValueError(f"policy code must be in 0..{len(POLICIES) - 1}, got {pol[bad[0]]!r} at sample {bad[0]}")
  needs_size = np.isin(pol, [_POLICY_CODE[FIXED_SIZE], _POLICY_CODE[SHUFFLE]])
  bad = np.flatnonzero(needs_size & ~((m >= 1) & (m <= n)))
  if bad.size:
    raise ValueError(f"sample_size must be in [1, population_size] for policy "
                     f"{policy_name(pol[bad[0]])!r}, got {m[bad[0]]!r} at sample {bad[0]}")
  if int(nq.sum()) != queries.shape[0]:
    raise ValueError(f"inconsistent ledger: samples declare {int(nq.sum())} queries, "
                     f"found {queries.shape[0]}")
  if queries.size:
    if not np.all(np.isfinite(queries)):
      i = int(np.argwhere(~np.isfinite(queries))[0][0])
      raise ValueError(f"query {i} has a non-finite field: {queries[i].tolist()}")
    expected_idx = np.repeat(np.arange(samples.shape[0]), nq.astype(np.int64))
    if not np.array_equal(queries[:, 0], expected_idx):
      raise ValueError("inconsistent ledger: query sample_index does not match the samples' "
                       "num_queries")
    kind = queries[:, 1]
    bad = np.flatnonzero(~np.isin(kind, list(_KIND_NAME)))
    if bad.size:
      raise ValueError(f"query kind must be in {sorted(_KIND_NAME)}, got {kind[bad[0]]!r} at query {bad[0]}")
    bad = np.flatnonzero(queries[:, 2] < 0)
    if bad.size:
      raise ValueError(f"query sensitivity (clip) must be >= 0, got {queries[bad[0], 2]!r} at query {bad[0]}")
    bad = np.flatnonzero(queries[:, 3] < 0)
    if bad.size:
      raise ValueError(f"query noise must be >= 0, got {queries[bad[0], 3]!r} at query {bad[0]}")
    bad = np.flatnonzero((kind == LAPLACE) & ((queries[:, 2] <= 0) | (queries[:, 3] <= 0)))
    if bad.size:
      raise ValueError(f"Laplace query needs l1_norm_clip > 0 and scale > 0, got "
                       f"{queries[bad[0], 2:].tolist()} at query {bad[0]}")
  return samples, queries


def _sample_signatures(samples, queries):
  """One row per sample: its sampling fields followed by its queries (for run-length coding)."""
  nq = samples[:, 4].astype(np.int64)
  width = int(nq.max()) if nq.size else 0
  sig = np.zeros([samples.shape[0], 4 + 3 * width])
  sig[:, :4] = samples[:, :4]
  if queries.size:
    starts = np.concatenate([[0], np.cumsum(nq)[:-1]])
    pos = np.arange(queries.shape[0]) - np.repeat(starts, nq)
    rows = queries[:, 0].astype(np.int64)
    for c in range(3):
      sig[rows, 4 + 3 * pos + c] = queries[:, 1 + c]
  return sig, nq


def run_length_encode(samples, queries):
  """Runs of consecutive identical samples: list of (count, sample_row, query_rows)."""
  if samples.shape[0] == 0:
    return []
  sig, nq = _sample_signatures(samples, queries)
  change = np.ones(sig.shape[0], dtype=bool)
  change[1:] = np.any(sig[1:] != sig[:-1], axis=1) | (nq[1:] != nq[:-1])
  heads = np.flatnonzero(change)
  counts = np.diff(np.append(heads, sig.shape[0]))
  qstart = np.concatenate([[0], np.cumsum(nq)])
  return [(int(c), samples[h], queries[qstart[h]:qstart[h] + nq[h]]) for h, c in zip(heads, counts)]


def arrays_to_dict(samples, queries):
  """Versioned, run-length coded JSON-able dict of a ledger."""
  runs = []
  for count, s, qs in run_length_encode(samples, queries):
    qlist = []
    for row in qs:
      kind = int(row[1])
      if kind == GAUSSIAN:
        qlist.append({"type": "gaussian", "l2_norm_clip": float(row[2]), "stddev": float(row[3])})
      elif kind == LAPLACE:
        qlist.append({"type": "laplace", "l1_norm_clip": float(row[2]), "scale": float(row[3])})
      else:
        qlist.append({"type": "non_private"})
    runs.append({"count": count, "population_size": float(s[0]),
                 "selection_probability": float(s[1]), "sample_size": float(s[2]),
                 "policy": policy_name(s[3]), "queries": qlist})
  return {"format": FORMAT_NAME, "version": FORMAT_VERSION,
          "num_samples": int(samples.shape[0]), "runs": runs}


def dict_to_runs(d):
  """Parses and validates a ledger dict into runs [(count, sample_row, query_rows)].

  Counts stay counts: a run of 10^6 identical samples is one row.
  """
  if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
    raise ValueError(f"not a tf_dpiter ledger: field 'format' must be {FORMAT_NAME!r}, "
                     f"got {d.get('format') if isinstance(d, dict) else type(d).__name__!r}")
  if d.get("version") != FORMAT_VERSION:
    raise ValueError(f"unsupported ledger version {d.get('version')!r}; this tf_dpiter reads "
                     f"version {FORMAT_VERSION}")
  runs = d.get("runs")
  if not isinstance(runs, list):
    raise ValueError(f"ledger field 'runs' must be a list, got {type(runs).__name__}")
  out = []
  for i, r in enumerate(runs):
    try:
      count = r["count"]
      if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"'count' must be a positive integer, got {count!r}")
      pol = policy_code(r["policy"])
      qs = []
      for q in r["queries"]:
        t = q["type"]
        if t == "gaussian":
          qs.append([0.0, GAUSSIAN, float(q["l2_norm_clip"]), float(q["stddev"])])
        elif t == "laplace":
          qs.append([0.0, LAPLACE, float(q["l1_norm_clip"]), float(q["scale"])])
        elif t == "non_private":
          qs.append([0.0, NON_PRIVATE, 0.0, 0.0])
        else:
          raise ValueError(f"query 'type' must be gaussian, laplace or non_private, got {t!r}")
      row = [float(r["population_size"]), float(r["selection_probability"]),
             float(r.get("sample_size", 0.0)), float(pol), float(len(qs))]
      s_arr, q_arr = validate_arrays(np.asarray([row]), np.asarray(qs).reshape(-1, 4))
    except (KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"ledger run {i} is malformed: missing or bad field {e}") from None
    except ValueError as e:
      raise ValueError(f"ledger run {i}: {e}") from None
    out.append((count, s_arr[0], q_arr))
  total = int(sum(c for c, _, _ in out))
  if d.get("num_samples", total) != total:
    raise ValueError(f"inconsistent ledger: 'num_samples' is {d.get('num_samples')!r} but the "
                     f"runs hold {total} samples")
  return out


def runs_to_arrays(runs):
  """Expands runs into (samples, queries) arrays."""
  if not runs:
    return np.zeros([0, len(SAMPLE_COLUMNS)]), np.zeros([0, len(QUERY_COLUMNS)])
  counts = np.asarray([c for c, _, _ in runs], dtype=np.int64)
  samples = np.repeat(np.stack([s for _, s, _ in runs]), counts, axis=0)
  blocks = [np.tile(q[:, 1:], (c, 1)) for c, _, q in runs]
  qbody = np.concatenate(blocks, axis=0) if blocks else np.zeros([0, 3])
  nq = samples[:, 4].astype(np.int64)
  sample_index = np.repeat(np.arange(samples.shape[0]), nq).astype(np.float64)
  queries = np.concatenate([sample_index[:, None], qbody], axis=1) if qbody.size else np.zeros([0, 4])
  return samples, queries


def dict_to_arrays(d):
  """Inverse of arrays_to_dict, with validation; ValueError on any malformed field."""
  return runs_to_arrays(dict_to_runs(d))
