"""The privacy ledger (McMahan et al. 2018, Section 6), held in TF variables.

It records *sampling events* (population size n, selection probability q, sample size,
policy, examples per record) and, for each, its *sum query events*: Gaussian (S_g,
sigma~_g), Laplace (C, b), non-private or correlated-noise steps (banded / tree / matrix,
refused under a sampling that does not cover them), each with its sensitivity under the
sample's neighbouring relation (`records.sensitivity_factor`: S for add/remove of a record,
2S for replace-one or a microbatch). It also counts shuffled passes. Writes work inside
`tf.function`; buffers double when full, so no event is dropped. A `tf.train.Checkpoint`
saves and restores it, and a restore never rolls it back: a mirror of every row this object
recorded, in no checkpoint, is reconciled with the restored rows before every write and
eager read (`reconcile`). File format and checks: `records` / `ledger_file`.

Every ledger object has a run identity (`run_ids`: 128 bits from the OS entropy source,
drawn when it is created) and a run table naming whose samples it holds; merges
(`merged_arrays`) deduplicate only within one identity, so two runs with equal rows are both
charged. The table is saved with the rows (checkpoint, signed dict, weights-file entry).

`LedgerSampling` is the declared sampling (n, q, policy, sample size, k) of the following
samples and the ledger `record(events)` writes them to.
"""

import json
import math
import typing

import numpy as np
import tensorflow as tf

from tf_dpiter import files
from tf_dpiter import validation
from tf_dpiter.dp_query import correlated_events
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.errors import ParameterTypeError
from tf_dpiter.errors import ParameterValueError
from tf_dpiter.errors import PrivacyConfigError
from tf_dpiter.ledger import correlated_records
from tf_dpiter.ledger import ledger_file
from tf_dpiter.ledger import policies
from tf_dpiter.ledger import records as rec
from tf_dpiter.ledger import run_ids
from tf_dpiter.ledger.records import (POISSON, QUERY_COLUMNS, REPLACE_ONE, SAMPLE_COLUMNS,
                                      policy_code)

def _f64(x):
  """float64 tensor; Python floats are converted at full precision (tf.cast would go via float32)."""
  return tf.cast(tf.convert_to_tensor(x, dtype_hint=tf.float64), tf.float64)


def _event_row(event, factor, policy, sample_size):
  """(kind, clip, noise, sensitivity) of one privacy event as float64 tensors, and its
  in-graph checks (`_correlated_row`)."""
  f = _f64
  if isinstance(event, events_lib.GaussianSumEvent):
    clip = f(event.l2_norm_clip)
    return [f(rec.GAUSSIAN), clip, f(event.stddev), factor * clip], []
  if isinstance(event, events_lib.LaplaceSumEvent):
    clip = f(event.l1_norm_clip)
    return [f(rec.LAPLACE), clip, f(event.scale), factor * clip], []
  if isinstance(event, events_lib.NonPrivateEvent):
    return [f(rec.NON_PRIVATE), f(0.0), f(0.0), f(0.0)], []
  if correlated_events.is_correlated_event(event):   # independent classes: checked last
    return _correlated_row(event, factor, policy, sample_size)
  raise PrivacyConfigError(f"events must be GaussianSumEvent, LaplaceSumEvent, NonPrivateEvent, "
                           f"BandedGaussianEvent, TreeGaussianEvent or MatrixGaussianEvent, got {event!r}")


def _correlated_row(event, factor, policy, sample_size):
  """Row and checks of a correlated-noise event (`correlated_records`' rules): policy and
  least sample_size checked (in the graph for a tensor); sensitivity >= factor x clip.

  Raises:
    PrivacyConfigError: the policy, or a Python sample_size, does not cover the event.
  """
  wide = event._replace(l2_norm_clip=_f64(event.l2_norm_clip), stddev=_f64(event.stddev))
  needed, least = correlated_records.correlated_requirement(event)
  checks = []
  if needed is not None and policy != needed:
    raise PrivacyConfigError(
        f"{type(event).__name__} is accounted only under sampling policy {needed!r}, got "
        f"policy {policy!r}: sample with "
        + ("dp.data.cyclic_poisson.cyclic_poisson_batches (num_groups >= "
           f"{least})" if needed == rec.CYCLIC_POISSON else "shuffled passes")
        + "; refusing to record an unproven guarantee")
  if needed is not None and tf.is_tensor(sample_size):
    checks.append(tf.debugging.assert_greater_equal(
        _f64(sample_size), _f64(least),
        message=f"{type(event).__name__} needs policy {needed!r} with sample_size (cycle "
                f"length) >= {least}; refusing to record an unproven guarantee"))
    values = correlated_records.correlated_row_values(wide, factor)
  else:
    values = correlated_records.correlated_query_row(wide, policy, sample_size, factor)
  kind, clip, noise, sensitivity = [_f64(v) for v in values]
  # a column norm may be 1 ulp below 1 in floating point: record at least factor x clip
  return [kind, clip, noise, tf.maximum(sensitivity, factor * clip)], checks


def _tensor_sensitivity_factor(relation, examples_per_record):
  """records.sensitivity_factor for a tensor k (float64 tensor)."""
  if relation == REPLACE_ONE:
    return _f64(2.0)
  return tf.where(_f64(examples_per_record) > 1.0, _f64(2.0), _f64(1.0))


class _HandleVariable:
  """A ledger variable seen through its resource handle (the shared write functions take
  handles, so no trace refers to a ledger's variables)."""

  def __init__(self, handle, dtype, shape):
    self.handle, self.dtype, self.shape = handle, dtype, tf.TensorShape(shape)

  def read_value(self):
    """The value (a tensor of the variable's dtype and shape)."""
    value = tf.raw_ops.ReadVariableOp(resource=self.handle, dtype=self.dtype)
    value.set_shape(self.shape)
    return value

  def __getitem__(self, key):
    return self.read_value()[key]

  def assign(self, value):
    """Assigns `value` (any first dimension for a buffer); returns the op."""
    return tf.raw_ops.AssignVariableOp(resource=self.handle,
                                       value=tf.convert_to_tensor(value, self.dtype),
                                       validate_shape=False)

  def assign_add(self, delta):
    """Adds `delta`; returns the new value."""
    op = tf.raw_ops.AssignAddVariableOp(resource=self.handle,
                                        value=tf.convert_to_tensor(delta, self.dtype))
    with tf.control_dependencies([op]):
      return self.read_value()

  def sparse_read(self, indices):
    """The rows `indices` (int64 [k])."""
    return tf.raw_ops.ResourceGather(resource=self.handle, indices=indices, dtype=self.dtype)

  def scatter_nd_update(self, indices, updates):
    """Writes `updates` at `indices` ([k, 1]); returns the op."""
    return tf.raw_ops.ResourceScatterNdUpdate(ref=self.handle, indices=indices,
                                              updates=updates)


class _Buffers:
  """One set of the ledger's variables (rows, counts, passes, cycle position, run table); a
  plain object, so tf.Module does not track it."""

  NAMES = ("samples", "queries", "sample_count", "query_count", "passes", "cycle_position",
           "run_table")
  SPECS = {"samples": (tf.float64, [None, len(SAMPLE_COLUMNS)]),
           "queries": (tf.float64, [None, len(QUERY_COLUMNS)]),
           **{name: (tf.int64, []) for name in NAMES[2:6]},
           "run_table": (tf.string, [])}

  def __init__(self, cap, suffix="", run_table=""):
    for name in self.NAMES:   # row buffers of `cap` zero rows, int64 counters at 0
      dtype, shape = self.SPECS[name]
      initial = (tf.zeros([cap, shape[1]], dtype) if shape
                 else tf.constant(run_table if dtype == tf.string else 0, dtype))
      setattr(self, name, tf.Variable(initial, shape=tf.TensorShape(shape), trainable=False,
                                      name=name + suffix))

  @classmethod
  def of(cls, handles):
    """The set whose variables' resource handles are `handles` (the shared functions' view)."""
    view = cls.__new__(cls)
    for name, handle in zip(cls.NAMES, handles):
      setattr(view, name, _HandleVariable(handle, *_Buffers.SPECS[name]))
    return view

  def handles(self):
    """The resource handles of the set's variables in `NAMES` order."""
    return tuple(getattr(self, name).handle for name in self.NAMES)

  def rows(self):
    """(samples, queries) up to the counts (tensors)."""
    return (self.samples[:self.sample_count.read_value()],
            self.queries[:self.query_count.read_value()])

  def assign_rows(self, samples, queries, passes, cyclic_codes=None, cycle_position=None):
    """Ops writing rows and a pass count; the cycle position is `cycle_position` or, when
    None, the count of samples whose policy code is in `cyclic_codes` (read eagerly)."""
    if cycle_position is None:
      cyclic = tf.constant(cyclic_codes, tf.float64)
      in_cycle = tf.reduce_any(tf.equal(samples[:, 3:4], cyclic[tf.newaxis]), axis=1)
      cycle_position = tf.reduce_sum(tf.cast(in_cycle, tf.int64))
    spare = lambda t: tf.concat([t, tf.zeros([1, t.shape[1]], t.dtype)], 0)  # capacity >= 1
    return [self.samples.assign(spare(samples)), self.queries.assign(spare(queries)),
            self.sample_count.assign(tf.shape(samples, out_type=tf.int64)[0]),
            self.query_count.assign(tf.shape(queries, out_type=tf.int64)[0]),
            self.passes.assign(passes),
            self.cycle_position.assign(cycle_position)]


def _common_prefix(a, b):
  """The number of leading samples two ledgers (samples, queries) share row for row."""
  (sa, qa), (sb, qb) = a, b
  m = min(sa.shape[0], sb.shape[0])
  same = np.all(sa[:m] == sb[:m], axis=1)
  p = m if same.all() else int(np.argmin(same))
  while p > 0:   # the query rows of the shared samples must match too
    qa_p, qb_p = qa[qa[:, 0] < p], qb[qb[:, 0] < p]
    if qa_p.shape == qb_p.shape and np.all(qa_p == qb_p):
      return p
    p -= 1
  return 0


# The cyclic grouping record of a ledger whose two sources recorded different ones: no
# grouping equals it, so a correlated cyclic run can only be refused, never continued.
GROUPING_CONFLICT = "conflict"


def merged_grouping(a, b):
  """The cyclic grouping record of two merged sources (str or None each): the one set, else
  `GROUPING_CONFLICT` when both are set and differ (a continuation is then refused)."""
  if a is None or a == b:
    return b
  return a if b is None else GROUPING_CONFLICT


def _table_of(state):
  """The run table of a state tuple (samples, queries, passes[, grouping[, table]]); a state
  without one is a run of its own (`run_ids.unknown`)."""
  table = state[4] if len(state) > 4 else None
  return (tuple(table) if table is not None
          else run_ids.unknown(state[0].shape[0], state[2]))


def merged_arrays(current, restored):
  """The ledger that charges every step of two ledgers once, `current` (being restored into)
  and `restored`, each (samples, queries, passes[, grouping[, table]]) with a run table of
  (id, samples, passes) segments (None or absent: one run of its own).

  Per run identity (`run_ids.merge_tables`): the longer of its two views (a run's ledger
  only appends), never their sum. Different identities are different runs, even with equal
  rows: both are charged, their passes added.

  Returns:
    (samples, queries, passes, grouping, table); the groupings merged by `merged_grouping`.

  Raises:
    PrivacyConfigError: two views of one run differ at a sample both hold (one was altered).
  """
  grouping = merged_grouping(current[3] if len(current) > 3 else None,
                             restored[3] if len(restored) > 3 else None)
  samples, queries, passes, table = run_ids.merge_tables(
      (*current[:3], _table_of(current)), (*restored[:3], _table_of(restored)),
      _common_prefix)
  return samples, queries, passes, grouping, table


def added_arrays(current, restored):
  """(samples, queries, passes, table) of what `restored` holds beyond `current` (as in
  `merged_arrays`), per run identity (`run_ids.additions`).

  Raises:
    PrivacyConfigError: two views of one run differ at a sample both hold.
  """
  return run_ids.additions((*current[:3], _table_of(current)),
                           (*restored[:3], _table_of(restored)), _common_prefix)


# The writes run in functions shared by every ledger (taking resource handles), traced once
# per process; the rare branches (growth, repair) are `_noinline` calls, built only when run.
_RARE = {"autograph": False, "experimental_attributes": {"_noinline": True}}


@tf.function(**_RARE)
def _grow_call(handle, needed, columns):
  """Doubles the float64 buffer behind `handle` (at least to `needed` rows, `columns` wide);
  returns True."""
  buffer = _HandleVariable(handle, tf.float64, [None, columns])
  cap = tf.raw_ops.VariableShape(input=handle, out_type=tf.int64)[0]
  new_cap = tf.maximum(2 * cap, needed)
  pad = tf.zeros(tf.stack([new_cap - cap, tf.constant(columns, tf.int64)]), tf.float64)
  with tf.control_dependencies([buffer.assign(tf.concat([buffer.read_value(), pad], axis=0))]):
    return tf.constant(True)


def _ensure_capacity(buffer, needed):
  """`_grow_call` when `buffer` holds fewer than `needed` rows; a bool tensor, True if grown."""
  cap = tf.raw_ops.VariableShape(input=buffer.handle, out_type=tf.int64)[0]
  return tf.cond(needed > cap, lambda: _grow_call(buffer.handle, needed, int(buffer.shape[1])),
                 lambda: tf.constant(False))


def _reconcile(v, m):
  """In-graph reconciliation of the checkpointed set `v` and the mirror `m` before a write:
  the longer when one is a prefix of the other; diverging sets fail the step (only the
  eager `PrivacyLedger.reconcile` merges them). O(1) a step unless counts or last rows
  differ. Returns the bool the writes depend on."""
  counts = [(b.sample_count.read_value(), b.query_count.read_value(), b.passes.read_value())
            for b in (v, m)]

  def last(buffer, n):   # the row before n (row 0 when n = 0: both then compare zeros)
    return buffer.sparse_read(tf.reshape(tf.maximum(n - 1, 0), [1]))

  same = [tf.equal(a, b) for a, b in zip(*counts)] + [
      tf.reduce_all(tf.equal(last(v.samples, counts[0][0]), last(m.samples, counts[1][0]))),
      tf.reduce_all(tf.equal(last(v.queries, counts[0][1]), last(m.queries, counts[1][1]))),
      tf.equal(v.run_table.read_value(), m.run_table.read_value())]

  def fix():
    return _fix_call(v.handles(), m.handles(), counts[0][2], counts[1][2])

  return tf.cond(tf.reduce_all(tf.stack(same)), lambda: tf.constant(False), fix)


@tf.function(**_RARE)
def _fix_call(v_handles, m_handles, v_passes, m_passes):
  """`_reconcile`'s repair: the longer set (with the larger pass count and its run table)
  copied onto the other when one is a prefix of the other and both have one run table, or
  the checkpointed set is empty; else the step fails. A restore of another run into an
  empty ledger fails too: only the eager `reconcile` can write this object's identity into
  the table (else two ledgers restored from one checkpoint would merge as one run)."""
  v, m = _Buffers.of(v_handles), _Buffers.of(m_handles)
  (vs, vq), (ms, mq) = v.rows(), m.rows()
  n = tf.minimum(tf.shape(vs)[0], tf.shape(ms)[0])
  nq = tf.minimum(tf.shape(vq)[0], tf.shape(mq)[0])
  empty = lambda b, passes: tf.logical_and(tf.equal(b.sample_count.read_value(), 0),  # noqa: E731
                                           tf.equal(passes, 0))
  one_run = tf.logical_or(tf.equal(v.run_table.read_value(), m.run_table.read_value()),
                          empty(v, v_passes))
  prefix = tf.logical_and(tf.logical_and(tf.reduce_all(tf.equal(vs[:n], ms[:n])),
                                         tf.reduce_all(tf.equal(vq[:nq], mq[:nq]))), one_run)
  check = tf.debugging.Assert(prefix, [
      "the privacy ledger was restored from a checkpoint of another run (after this "
      "ledger recorded steps, or into a new ledger written next inside tf.function): call "
      "ledger.reconcile() eagerly after the restore, before the next write, to merge the "
      "two, or use a new optimizer for the other run"])
  passes = tf.maximum(v_passes, m_passes)
  with tf.control_dependencies([check]):
    copy = lambda to, rows, queries, src: tf.group(to.assign_rows(  # noqa: E731
        rows, queries, passes, cycle_position=src.cycle_position.read_value())
        + [to.run_table.assign(src.run_table.read_value())])
    done = tf.cond(tf.shape(ms)[0] >= tf.shape(vs)[0], lambda: copy(v, ms, mq, m),
                   lambda: copy(m, vs, vq, v))
  with tf.control_dependencies([done]):
    return tf.constant(True)


def _append(b, row, qrows, cyclic):
  """Appends one sample row [1, 6] and its query rows [Q, 4] (None: Q = 0), indexed by this
  sample, to the buffers `b` (grown when full); returns the new sample count."""
  idx = b.sample_count.read_value()
  qidx = b.query_count.read_value()
  n_q = 0 if qrows is None else int(qrows.shape[0])
  grew = [_ensure_capacity(b.samples, idx + 1)]
  if n_q:
    grew.append(_ensure_capacity(b.queries, qidx + n_q))
  with tf.control_dependencies(grew):
    ops = [b.samples.scatter_nd_update(tf.reshape(idx, [1, 1]), row)]
    if n_q:
      indexed = tf.concat([tf.fill([n_q, 1], tf.cast(idx, tf.float64)), qrows], 1)
      qind = tf.reshape(qidx + tf.range(n_q, dtype=tf.int64), [-1, 1])
      ops.append(b.queries.scatter_nd_update(qind, indexed))
  if cyclic:
    ops.append(b.cycle_position.assign_add(1))
  with tf.control_dependencies(ops):
    b.query_count.assign_add(n_q)
    return b.sample_count.assign_add(1)


@tf.function(autograph=False)
def _add_passes_call(v_handles, m_handles, count):
  """Reconciles the two sets, then adds `count` passes to both; returns the new count."""
  v, m = _Buffers.of(v_handles), _Buffers.of(m_handles)
  with tf.control_dependencies([_reconcile(v, m)]):
    m.passes.assign_add(count)
    return v.passes.assign_add(count)


@tf.function(autograph=False)
def _append_call(v_handles, m_handles, row, qrows, cyclic):
  """Reconciles the two sets, then appends one sample to the mirror and the checkpointed set;
  returns the new sample count."""
  v, m = _Buffers.of(v_handles), _Buffers.of(m_handles)
  with tf.control_dependencies([_reconcile(v, m)]):
    _append(m, row, qrows, cyclic)
    return _append(v, row, qrows, cyclic)


class PrivacyLedger(tf.Module):
  """Growable record of sampling and sum-query events, in TF variables.

  Args:
    initial_capacity: rows allocated for samples (and queries) before the buffers grow.
    name: the tf.Module's name (and name scope of its variables).

  Raises:
    ParameterValueError: initial_capacity < 1.
  """

  def __init__(self, initial_capacity=1024, name="privacy_ledger"):
    super().__init__(name=name)
    cap = int(initial_capacity)
    if cap < 1:
      raise ParameterValueError(f"initial_capacity must be >= 1, got {initial_capacity!r}")
    self._own_id = run_ids.new_id()   # this object's run identity (`run_ids`)
    table = run_ids.encode((), self._own_id)
    with tf.name_scope(name):
      self._v = _Buffers(cap, run_table=table)                  # checkpoints save/restore it
      self._mirror = _Buffers(cap, "_mirror", run_table=table)  # this object's: no checkpoint
    for attr in _Buffers.NAMES:   # tracked under the names of earlier versions' checkpoints
      setattr(self, "_" + attr, getattr(self._v, attr))
    # `cyclic_grouping`, checkpointed ("" when none); what this object set is kept aside too
    with tf.name_scope(name):
      self._cyclic_grouping = tf.Variable("", dtype=tf.string, trainable=False,
                                          name="cyclic_grouping")
    self._grouping_set_here = None

  def reconcile(self):
    """Merges the checkpointed rows and the rows this object recorded (`merged_arrays`), so
    that a restore never lowers the ledger; eager. Call it after restoring another run's
    checkpoint into a used ledger (eager reads call it when the counts differ).
    """
    restored, mine = (self._buffer_state(b) for b in (self._v, self._mirror))
    if not all(np.array_equal(a, b) for a, b in zip(restored[:3], mine[:3])) or (
        restored[4] != mine[4]):   # rows, passes, run tables
      samples, queries, passes, _, table = merged_arrays(mine, restored)
      self._write(samples, queries, passes, table)

  @staticmethod
  def _buffer_state(b):
    """(samples, queries, passes, None, run table) of one buffer set, eagerly."""
    samples, queries = (t.numpy() for t in b.rows())
    passes = int(b.passes.numpy())
    return (samples, queries, passes, None,
            run_ids.explicit(b.run_table.numpy().decode(), samples.shape[0], passes))

  @property
  def run_id(self):
    """This ledger object's run identity (32 hex digits): the samples it records are its."""
    return self._own_id

  def run_table(self):
    """The run table (`run_ids`): (id or None, samples, passes) segments covering the samples
    in order, after reconciling a restore (eager).

    Returns:
      tuple of (str or None, int, int).
    """
    n, passes = int(self.sample_count.numpy()), int(self.passes.numpy())
    table = run_ids.explicit(self._v.run_table.numpy().decode(), n, passes)
    return tuple(t for t in table if t[1] or t[2]) or table[-1:]

  @property
  def cyclic_grouping(self):
    """The grouping record of the cyclic Poisson run this ledger charges (eager): "sha256:" +
    the SHA-256 of the run's sorted example identity digests, `GROUPING_CONFLICT` after a
    merge of two, or None. Ledger state (every file of the ledger carries it), so a later fit
    continues a correlated-noise run only with the same grouping
    (`data.cyclic_poisson.check_continuation`)."""
    saved = self._cyclic_grouping.numpy().decode() or None
    return merged_grouping(self._grouping_set_here, saved)

  def set_cyclic_grouping(self, grouping):
    """Records the grouping of the cyclic run that starts now (eager).

    Args:
      grouping: a str (`CyclicPoissonSampler.grouping`), or None to clear the record.

    Raises:
      ParameterTypeError: `grouping` is neither a str nor None.
    """
    if grouping is not None and not isinstance(grouping, str):
      raise ParameterTypeError(f"grouping must be a str or None. Received: grouping={grouping!r}")
    self._grouping_set_here = grouping
    self._cyclic_grouping.assign(grouping or "")

  def _merge_grouping(self, grouping):
    """Merges a restored source's grouping record into this one (`merged_grouping`)."""
    if grouping is None:
      return
    merged = merged_grouping(self.cyclic_grouping, grouping)
    self._grouping_set_here = merged
    self._cyclic_grouping.assign(merged)

  def _write(self, samples, queries, passes, table=None):
    """Writes numpy rows (already validated), a pass count and their run table (None: one
    run of unknown identity) to both sets, eagerly."""
    codes = policies.cyclic_codes()
    if table is None:
      table = run_ids.unknown(samples.shape[0], passes)
    stored = run_ids.stored(run_ids.check_table(table, samples.shape[0], passes),
                            self._own_id)
    for b in (self._v, self._mirror):
      b.assign_rows(tf.constant(samples, tf.float64), tf.constant(queries, tf.float64),
                    tf.constant(int(passes), tf.int64), codes)
      b.run_table.assign(stored)

  def _read(self, name):
    """A count: eagerly after `_settle`; in a graph the larger of the two sets'."""
    v, m = getattr(self._v, name), getattr(self._mirror, name)
    if tf.executing_eagerly():
      self._settle()
      return v.read_value()
    return tf.maximum(v.read_value(), m.read_value())

  def _settle(self):
    """Eagerly, `reconcile` when the two sets differ (a restore since the last write)."""
    if tf.executing_eagerly() and (
        any(int(getattr(self._v, k).numpy()) != int(getattr(self._mirror, k).numpy())
            for k in ("sample_count", "query_count", "passes"))
        or self._v.run_table.numpy() != self._mirror.run_table.numpy()):
      self.reconcile()

  @property
  def sample_count(self):
    """Samples recorded so far (int64 tensor; never lowered by a restore)."""
    return self._read("sample_count")

  @property
  def query_count(self):
    """Query rows recorded so far (int64 tensor)."""
    return self._read("query_count")

  @property
  def passes(self):
    """Shuffled passes (permutations) started by the samplers feeding this ledger."""
    return self._read("passes")

  @property
  def cycle_position(self):
    """The cyclic Poisson schedule's position: the cyclic_poisson samples recorded (int64).

    The next cyclic step samples group cycle_position mod b. A pure read (the larger of the
    two sets'): a tf.data thread reads it while a step may be writing.
    """
    return tf.maximum(self._v.cycle_position.read_value(),
                      self._mirror.cycle_position.read_value())

  def record_passes(self, count):
    """Adds `count` (>= 0) passes started; eager or inside tf.function. Returns the new total.

    Args:
      count: int or int tensor, passes started (>= 0).

    Returns:
      The new total pass count (int64, from assign_add).

    Raises:
      ParameterValueError: if a Python/numpy int `count` is negative.
    """
    if isinstance(count, (int, np.integer)) and count < 0:
      raise ParameterValueError(f"count must be >= 0, got {count!r}")
    self._settle()
    return _add_passes_call(self._v.handles(), self._mirror.handles(),
                            tf.cast(count, tf.int64))

  def record_sample(self, population_size, selection_probability, events,
                    policy=POISSON, sample_size=0, examples_per_record=1):
    """Records one sample (sampling event) and its sum query events.

    Eager or inside `tf.function` (not under XLA: the buffers grow); n, q, sample_size and k
    may be tensors. Each query's sensitivity is `records.sensitivity_factor(relation, k)` times
    its clip (times the strategy's column norm for a correlated event).

    Args:
      population_size: n, the population the sample was drawn from (float or tensor).
      selection_probability: q, each record's probability to be in the sample.
      events: the tuple of privacy events `DPQuery.get_noised_result` returned.
      policy: the sampling policy, one of records.ALL_POLICIES.
      sample_size: the batch size (the cycle length b under cyclic_poisson; 0 for Poisson).
      examples_per_record: k, the examples in one record (1: a record is an example).

    Raises:
      PrivacyConfigError: unknown policy or event, microbatches (k > 1) under add/remove, or
        a correlated-noise event its sampling does not cover.
      tf.errors.InvalidArgumentError: (when run) a tensor sample_size below the least the
        correlated-noise event needs.
    """
    sampling = policies.get(policy)   # its code, relation and cycle rule, read once
    rec.check_examples_per_record(policy, examples_per_record)
    if isinstance(examples_per_record, (int, float, np.integer, np.floating)):
      factor = rec.sensitivity_factor(sampling.relation, examples_per_record)
    else:
      factor = _tensor_sensitivity_factor(sampling.relation, examples_per_record)
    return self.append_sample(population_size, selection_probability, events, sampling,
                              sample_size, examples_per_record, factor)

  def append_sample(self, population_size, selection_probability, events, sampling,
                    sample_size, examples_per_record, factor):
    """`record_sample` with its policy and k checked and its sensitivity factor formed.

    Args:
      population_size: n (float or tensor).
      selection_probability: q (float or tensor).
      events: the tuple of privacy events `DPQuery.get_noised_result` returned.
      sampling: the registered policy object (`policies.get(policy)`).
      sample_size: the batch size (float or tensor).
      examples_per_record: k, checked against the policy.
      factor: `records.sensitivity_factor(sampling.relation, k)` (float or float64 tensor).

    Returns:
      the ledger's new sample count (int64 tensor).

    Raises:
      PrivacyConfigError: an unknown event, or a correlated-noise event its sampling does not
        cover.
    """
    policy = sampling.name
    factor = _f64(factor)
    built = [_event_row(e, factor, policy, sample_size) for e in tuple(events)]
    checks = [c for _, cs in built for c in cs]
    # the sample row [1, 6] and the query rows [Q, 4] (without their index), for both sets
    row = tf.stack([_f64(x) for x in (population_size, selection_probability, sample_size,
                                      sampling.code, examples_per_record, len(built))])[None]
    qrows = tf.stack([tf.stack(r) for r, _ in built]) if built else None
    self._settle()
    with tf.control_dependencies(checks):
      return _append_call(self._v.handles(), self._mirror.handles(), row, qrows,
                          bool(sampling.advances_cycle))

  # ---- reading and (de)serialization ---------------------------------------------------

  def get_arrays(self, start=0):
    """(samples [N, 6], queries [Q, 5]) float64 numpy arrays of samples start.. (query rows keep
    their absolute sample_index), after reconciling a restore.

    Args:
      start: the index of the first sample returned (0: all).

    Returns:
      (samples [N, 6], queries [Q, 5]), float64 numpy arrays.
    """
    n = int(self.sample_count.numpy())
    q = int(self._v.query_count.numpy())
    samples = self._v.samples[start:n].numpy()
    if start == 0:
      return samples, self._v.queries[:q].numpy()
    skipped = int(self._v.samples[:start, len(SAMPLE_COLUMNS) - 1].numpy().sum())
    return samples, self._v.queries[skipped:q].numpy()

  def set_arrays(self, samples, queries, passes=None, grouping=None, runs=None):
    """Replaces the content by validated arrays (a new ledger read from a file; restores of a
    run's ledger go through `merge_arrays`, which never loses a row).

    Args:
      samples: ledger sample array (rows of SAMPLE_COLUMNS).
      queries: ledger query array (rows of QUERY_COLUMNS).
      passes: int pass count, or None to keep the current one.
      grouping: the cyclic grouping record (`cyclic_grouping`), or None to keep the current.
      runs: their run table (`run_ids`), or None: one run of unknown identity.

    Raises:
      PrivacyConfigError: the arrays are malformed (records.validate_arrays).
      ParameterValueError: `runs` does not cover them (`run_ids.check_table`).
    """
    samples, queries = rec.validate_arrays(samples, queries)
    self._write(samples, queries, int(self.passes.numpy()) if passes is None else int(passes),
                runs)
    if grouping is not None:
      self.set_cyclic_grouping(grouping)

  def merge_arrays(self, samples, queries, passes=0, grouping=None, runs=None):
    """Merges another ledger into this one by run identity (`merged_arrays`): nothing recorded
    here is lost; another run's samples are added.

    Args:
      samples: ledger sample array (rows of SAMPLE_COLUMNS).
      queries: ledger query array (rows of QUERY_COLUMNS).
      passes: int, the shuffled passes that ledger counted.
      grouping: that ledger's cyclic grouping record (str or None), merged by
        `merged_grouping`.
      runs: that ledger's run table (`run_ids`; `state()`'s last item), or None: a run of
        its own (charged in full).

    Raises:
      PrivacyConfigError: the arrays are malformed (records.validate_arrays), or a view of a
        run this ledger holds that differs from its view here at a sample both hold.
      ParameterValueError: `runs` does not cover them (`run_ids.check_table`).
    """
    samples, queries = rec.validate_arrays(samples, queries)
    if runs is not None:
      runs = run_ids.check_table(runs, samples.shape[0], passes)
    self._merge_grouping(grouping)
    self.reconcile()
    current = self.state()
    merged = merged_arrays(current, (samples, queries, int(passes), None, runs))
    if (merged[2] != current[2] or merged[4] != current[4]
        or not np.array_equal(merged[0], current[0])
        or not np.array_equal(merged[1], current[1])):
      self._write(merged[0], merged[1], merged[2], merged[4])

  def to_dict(self, key=None):
    """The signed JSON-able dict (see ledger_file); `key` adds an HMAC.

    Args:
      key: optional HMAC key (str or bytes).

    Returns:
      dict (see `ledger_file.arrays_to_dict`).
    """
    return ledger_file.arrays_to_dict(*self.get_arrays(), passes=int(self._v.passes.numpy()),
                                      key=key, grouping=self.cyclic_grouping,
                                      runs=self.run_table())

  def state(self):
    """(samples, queries, passes, grouping, run table): what `merge_arrays` takes (eager)."""
    return (*self.get_arrays(), int(self.passes.numpy()), self.cyclic_grouping,
            self.run_table())

  def to_json(self, key=None):
    """The signed ledger as a JSON string.

    Args:
      key: optional HMAC key (str or bytes).

    Returns:
      str (see `ledger_file`).
    """
    return json.dumps(self.to_dict(key))

  def save_json(self, path, key=None):
    """Writes the signed JSON file (atomically: a crash leaves the old file or the new one,
    `files.replaced`).

    Args:
      path: destination file path (written beside it under a temporary name, then renamed).
      key: optional HMAC key (str or bytes). Without it the file carries only a SHA-256
        digest, which detects accidents, not forgery (anyone can recompute it); with it,
        `load_json(path, key)` / `privacy_report(..., key=key)` refuse a forged file.
    """
    text = self.to_json(key)
    with files.replaced(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
      f.write(text)

  def __deepcopy__(self, memo):
    """A copy (`copy.deepcopy`, eager) is another run from here on: it holds this ledger's
    rows under their identities and records its own under a new one (a fork: both charged)."""
    twin = self._from_arrays(*self.state())
    memo[id(self)] = twin
    return twin

  def __reduce__(self):
    """Pickling (eager) as `__deepcopy__`: the unpickled ledger is another run from here on."""
    return self._from_arrays, self.state()

  def __copy__(self):
    """`copy.copy`: another handle on this ledger (the same variables and identity)."""
    twin = type(self).__new__(type(self))
    twin.__dict__.update(self.__dict__)
    return twin

  @classmethod
  def _from_arrays(cls, samples, queries, passes, grouping=None, runs=None):
    ledger = cls(initial_capacity=max(1, samples.shape[0]))
    ledger.set_arrays(samples, queries, passes, grouping, runs)
    return ledger

  @classmethod
  def from_dict(cls, d, key=None):
    """A PrivacyLedger holding a ledger dict's samples and passes.

    Args:
      d: a signed ledger dict.
      key: the HMAC key it was signed with, or None.

    Returns:
      a new PrivacyLedger.

    Raises:
      ParameterValueError: the dict is malformed, altered or version 1 (ledger_file).
    """
    return cls._from_arrays(*ledger_file.dict_to_state(d, key))

  @classmethod
  def from_json(cls, text, key=None):
    """A PrivacyLedger from a JSON string (see `from_dict`).

    Args:
      text: the JSON.
      key: the HMAC key, or None.

    Returns:
      a new PrivacyLedger.

    Raises:
      ParameterValueError: unparsable, malformed, altered or version-1 JSON.
    """
    return cls._from_arrays(*ledger_file.loads(text, key, with_grouping=True))

  @classmethod
  def load_json(cls, path, key=None):
    """Reads a file written by save_json; ValueError if it is malformed, altered or v1.

    Args:
      path: path of the ledger JSON file.
      key: optional HMAC key to verify with.

    Returns:
      A new PrivacyLedger holding the file's content.
    """
    return cls._from_arrays(*ledger_file.load(path, key, with_grouping=True))


_SAMPLE_SIZE = ("a finite number >= 0, the batch size: the expected one under \"poisson\" "
                "(q * n; 0 when not known) and the number of examples per batch under "
                "\"shuffle\" and \"fixed_size\"; pass it, or leave the default")


def check_sample_size(sample_size):
  """float(sample_size) of a declared batch size, refused unless a finite number >= 0 (e.g.
  None); a tensor passes unchanged (checked by the policy when it is read).

  Raises:
    ParameterTypeError: `sample_size` is not a number (None, a string, a bool).
    PrivacyConfigError: `sample_size` is negative, NaN or infinite.
  """
  if tf.is_tensor(sample_size):
    return sample_size
  try:
    value = validation.check_number("sample_size", sample_size)
  except ParameterTypeError:
    raise ParameterTypeError(
        validation.message("sample_size", _SAMPLE_SIZE, sample_size)) from None
  if not math.isfinite(value) or value < 0:
    raise PrivacyConfigError(validation.message("sample_size", _SAMPLE_SIZE, sample_size))
  return value


@typing.final
class LedgerSampling:
  """The sampling of the following samples (n, q, policy, sample size, k) and the ledger each
  `record` writes to. n, q and the sample size are float64 variables (`set_sampling` changes
  them without a retrace); k takes effect at the next trace.

  Attributes:
    public_row_bound: R, the policy's public bound on a step's rows for the declared n and q
      (an int, None under replace-one), formed with every declaration, never from a batch;
      read by a step when traced. Read only.
  """

  def __init__(self, population_size, selection_probability, ledger=None,
               policy=POISSON, sample_size=0, examples_per_record=1):
    """Checks the declaration and makes its variables.

    Args:
      population_size: n > 0.
      selection_probability: q in (0, 1].
      ledger: a PrivacyLedger (a new one by default).
      policy: one of ledger.POLICIES.
      sample_size: the batch size (required in [1, n] for fixed_size and shuffle).
      examples_per_record: k, the microbatch size (1: a record is an example).

    Raises:
      PrivacyConfigError: a value out of range (sample_size not a finite number >= 0
        included), or k > 1 under an add/remove policy.
    """
    policy_code(policy)
    self._check(population_size, selection_probability, sample_size, policy)
    self._policy = policy
    self._policy_object = policies.get(policy)
    self._set_examples_per_record(examples_per_record)
    self._ledger = ledger if ledger is not None else PrivacyLedger()
    self._population_size = tf.Variable(float(population_size), dtype=tf.float64,
                                        trainable=False, name="population_size")
    self._selection_probability = tf.Variable(float(selection_probability), dtype=tf.float64,
                                              trainable=False, name="selection_probability")
    self._sample_size = tf.Variable(float(sample_size), dtype=tf.float64, trainable=False,
                                    name="sample_size")
    self.public_row_bound = self._policy_object.public_row_bound(population_size,
                                                                 selection_probability)
    self._declared = (float(population_size), float(selection_probability))
    self._replicas_read = set()

  def replica_row_bound(self, replicas):
    """R_P, the public bound on one replica's rows under `replicas` replicas for the declared
    n and q (`SamplingPolicy.replica_row_bound`; R when P = 1; None under replace-one). The
    counts read are kept for `row_bound_key`.

    Args:
      replicas: P >= 1.

    Returns:
      an int, or None.
    """
    replicas = max(int(replicas), 1)
    self._replicas_read.add(replicas)
    if replicas == 1:   # R itself (formed at the declaration)
      return self.public_row_bound
    return self._policy_object.replica_row_bound(*self._declared, replicas)

  @property
  def row_bound_key(self):
    """(R, R_P for every P read so far): a declaration that changes it asks for a retrace."""
    return (self.public_row_bound,) + tuple(
        (p, self._policy_object.replica_row_bound(*self._declared, p))
        for p in sorted(self._replicas_read))

  @staticmethod
  def _check(population_size, selection_probability, sample_size, policy):
    validation.check_positive("population_size", population_size)
    validation.check_probability("selection_probability", selection_probability)
    check_sample_size(sample_size)
    if policy == rec.REPEAT_AND_SELECT:
      raise PrivacyConfigError(f"{policy!r} marks a private selection (tf_dpiter.tuning), "
                               "not a sampling policy")
    bad = policies.get(policy).check_sampling(population_size, selection_probability,
                                              sample_size)
    if bad is not None:
      raise PrivacyConfigError(bad)

  def _set_examples_per_record(self, examples_per_record):
    """Checks k against the policy and forms the sensitivity factor, once per declaration."""
    rec.check_examples_per_record(self._policy, examples_per_record)
    self._examples_per_record = int(examples_per_record)
    self._factor = rec.sensitivity_factor(self._policy_object.relation,
                                              self._examples_per_record)

  @property
  def ledger(self):
    """The PrivacyLedger every `record` writes to."""
    return self._ledger

  @property
  def population_size(self):
    """n recorded with the following samples (float64 tensor; `set_sampling` changes it)."""
    return self._population_size.read_value()

  @property
  def selection_probability(self):
    """q recorded with the following samples (float64 tensor)."""
    return self._selection_probability.read_value()

  @property
  def sample_size(self):
    """The batch size recorded with the following samples (float64 tensor; 0 for Poisson)."""
    return self._sample_size.read_value()

  @property
  def policy(self):
    """The sampling policy recorded with every sample (one of ledger.POLICIES)."""
    return self._policy

  @property
  def examples_per_record(self):
    """k, the examples in one record (1: a record is an example; k > 1: a microbatch)."""
    return self._examples_per_record

  def config(self):
    """The declaration as plain numbers (dict of n, q, policy, sample_size, k)."""
    return {"population_size": float(self._population_size.numpy()),
            "selection_probability": float(self._selection_probability.numpy()),
            "policy": self._policy, "sample_size": float(self._sample_size.numpy()),
            "examples_per_record": self._examples_per_record}

  def set_sampling(self, population_size, selection_probability, sample_size=None,
                   examples_per_record=None):
    """Changes n, q (sample size, examples per record) for the following samples, and forms
    their `public_row_bound` again.

    A change of examples_per_record or of the public row bound takes effect at the next trace.

    Args:
      population_size: n > 0.
      selection_probability: q in (0, 1].
      sample_size: the batch size (required in [1, n] for fixed_size and shuffle; None keeps the
        current one).
      examples_per_record: k >= 1 (None keeps it).

    Raises:
      PrivacyConfigError: a value out of range, or k > 1 under an add/remove policy.
    """
    if sample_size is None:
      sample_size = float(self._sample_size.numpy())
    self._check(population_size, selection_probability, sample_size, self._policy)
    if examples_per_record is not None:
      self._set_examples_per_record(examples_per_record)
    self._population_size.assign(float(population_size))
    self._selection_probability.assign(float(selection_probability))
    self._sample_size.assign(float(sample_size))
    self.public_row_bound = self._policy_object.public_row_bound(population_size,
                                                                 selection_probability)
    self._declared = (float(population_size), float(selection_probability))

  def record(self, events, after=None):
    """Records one sample (n, q, policy, sample size, k) with `events`, those of one noised
    result (also of a draw inside an XLA program: this runs outside it).

    In a traced step the write's inputs are variables and constants: without an edge to the
    step's data it would run even when the step's input failed, charging a sample no update
    used. `after` gives that edge: the write runs iff its first tensor was computed.

    Args:
      events: the tuple of privacy events of one noised result.
      after: optional nest; in a traced step the write waits for its first tensor (a tensor
        of the batch, or the step's clipped sum).

    Returns:
      the ledger's new sample count (int64 tensor).
    """
    waits = [] if after is None or tf.executing_eagerly() else [
        t for t in tf.nest.flatten(after) if tf.is_tensor(t)][:1]
    with tf.control_dependencies(waits):
      return self._ledger.append_sample(self._population_size, self._selection_probability,
                                        events, self._policy_object, self._sample_size,
                                        self._examples_per_record, self._factor)
