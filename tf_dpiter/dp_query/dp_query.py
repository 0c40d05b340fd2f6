"""The DPQuery interface (seed 002, Section 7) and the sum-aggregation base class.

A DPQuery turns a sample of records into a private aggregate in four moves:
params = derive_sample_params(global_state); each record is clipped by
preprocess_record(params, record) and added into a sample state; sample states from
different workers merge; get_noised_result adds noise and returns the result, the next
global state and the privacy *events* (in sum units) that the ledger records.
Every method is graph-compatible: it works inside `tf.function`, and with
`jit_compile=True` wherever no data-dependent shape is involved.
"""

import abc
import collections

import tensorflow as tf


def zeros_like_template(template):
  """Zeros shaped like a record template.

  Args:
    template: a nest of tensors, variables or `tf.TensorSpec`s.
  Returns:
    the same nest of zero tensors.
  """
  def _zeros(t):
    if isinstance(t, tf.TensorSpec):
      return tf.zeros(t.shape, t.dtype)
    t = tf.convert_to_tensor(t)
    return tf.zeros_like(t)
  return tf.nest.map_structure(_zeros, template)


def global_l2_norm(record):
  """||x||_2 of a nest of tensors taken as one concatenated vector (float32).

  Args:
    record: a nest of numeric tensors.
  Returns:
    a scalar float32 tensor.
  """
  leaves = [tf.cast(x, tf.float32) for x in tf.nest.flatten(record)]
  return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(x)) for x in leaves]))


def clip_by_global_l2_norm(record, l2_norm_clip):
  """pi_S(x) = x * min(1, S / ||x||_2) (seed 002, Section 1), over the whole nest.

  Args:
    record: a nest of float tensors x.
    l2_norm_clip: S >= 0, a number or scalar tensor; S = +inf leaves x unchanged, and
      ||x|| = 0 gives factor 1.
  Returns:
    (clipped_record, norm_before_clipping): the clipped nest (same dtypes) and ||x||_2.
  """
  norm = global_l2_norm(record)
  clip = tf.cast(l2_norm_clip, tf.float32)
  # min(1, S/||x||); ||x|| = 0 gives factor 1 and S = inf gives factor 1.
  factor = tf.minimum(1.0, clip / tf.maximum(norm, 1e-30))
  clipped = tf.nest.map_structure(lambda x: x * tf.cast(factor, x.dtype), record)
  return clipped, norm


def _is_nest(x):
  return isinstance(x, (dict, list, tuple))


def map_up_to(shallow, fn, *structures):
  """Applies fn at the leaves of `shallow`, passing the matching subtrees of `structures`.

  Args:
    shallow: a dict/list/tuple/namedtuple nest; the structures share its structure down to
      its leaves and may go deeper below them.
    fn: called as fn(*subtrees) at every leaf of `shallow`.
    *structures: the nests to walk.
  Returns:
    a nest shaped like `shallow` holding fn's results (dict keys in tf.nest order).
  Raises:
    ValueError: a structure does not match `shallow`.
  """
  if not _is_nest(shallow):
    return fn(*structures)
  if isinstance(shallow, dict):
    for s in structures:
      if not isinstance(s, dict) or set(s) != set(shallow):
        raise ValueError(f"structure mismatch: expected keys {sorted(shallow)}, got {s!r}")
    return type(shallow)((k, map_up_to(shallow[k], fn, *(s[k] for s in structures)))
                         for k in sorted(shallow))  # tf.nest order
  for s in structures:
    if not _is_nest(s) or len(s) != len(shallow):
      raise ValueError(f"structure mismatch: expected {len(shallow)} parts, got {s!r}")
  parts = [map_up_to(sh, fn, *(s[i] for s in structures)) for i, sh in enumerate(shallow)]
  if hasattr(shallow, "_fields"):
    return type(shallow)(*parts)
  return type(shallow)(parts)


def flatten_up_to(shallow, structure):
  """The subtrees of `structure` at the leaves of `shallow`, in tf.nest.flatten order.

  Args:
    shallow: the nest whose leaves cut `structure`; structure: a nest at least as deep.
  Returns:
    a list of subtrees.
  """
  out = []
  map_up_to(shallow, lambda s: out.append(s), structure)
  return out


class DPQuery(metaclass=abc.ABCMeta):
  """Interface of a differentially private query over a sample of records."""

  def initial_global_state(self):
    """State carried from sample to sample (e.g. the current clip); default: ()."""
    return ()

  def derive_sample_params(self, global_state):
    """Parameters used to preprocess every record of one sample."""
    del global_state
    return ()

  @abc.abstractmethod
  def initial_sample_state(self, template):
    """Empty accumulator for a record shaped like `template`."""

  @abc.abstractmethod
  def preprocess_record(self, params, record):
    """Clips (or otherwise bounds) one record."""

  @abc.abstractmethod
  def accumulate_preprocessed_record(self, sample_state, preprocessed_record):
    """Adds a preprocessed record into the sample state."""

  def accumulate_record(self, params, sample_state, record):
    """preprocess_record followed by accumulate_preprocessed_record."""
    return self.accumulate_preprocessed_record(
        sample_state, self.preprocess_record(params, record))

  def accumulate_records(self, params, sample_state, records, mask=None):
    """Accumulates a batch (leading axis of every leaf) record by record.

    Generic fallback, a `tf.while_loop`; sum-aggregation queries override it with a
    vectorized version. Records whose `mask` entry is 0 are skipped.
    """
    n = tf.shape(tf.nest.flatten(records)[0])[0]

    def body(i, state):
      record = tf.nest.map_structure(lambda x: x[i], records)
      new_state = self.accumulate_record(params, state, record)
      if mask is not None:
        keep = mask[i] > 0
        new_state = tf.nest.map_structure(lambda a, b: tf.where(keep, a, b), new_state, state)
      return i + 1, new_state

    _, state = tf.while_loop(lambda i, _: i < n, body, (tf.constant(0), sample_state))
    return state

  @abc.abstractmethod
  def merge_sample_states(self, sample_state_1, sample_state_2):
    """Combines two sample states (e.g. from two replicas)."""

  @abc.abstractmethod
  def get_noised_result(self, sample_state, global_state):
    """Returns (result, new_global_state, events); events in sum units."""

  def derive_metrics(self, global_state):
    """Metrics derived from the global state (e.g. the current clip)."""
    del global_state
    return collections.OrderedDict()

  # ---- serialization (see tf_dpiter.dp_query.serialization) ---------------------------

  def get_config(self):
    """Constructor arguments as plain Python values (child queries serialized).

    The default serves classes whose constructor takes no argument; others override it.
    """
    if type(self).__init__ is object.__init__:
      return {}
    raise NotImplementedError(
        f"{type(self).__qualname__}.get_config() is not implemented: return the constructor "
        "arguments as plain Python values (child queries through "
        "tf_dpiter.dp_query.serialize) to make this query serializable")

  @classmethod
  def from_config(cls, config):
    """The query built from `get_config()`'s output: cls(**config) by default."""
    return cls(**config)


class SumAggregationDPQuery(DPQuery):
  """A DPQuery whose sample state is the plain sum of preprocessed records."""

  def initial_sample_state(self, template):
    return zeros_like_template(template)

  def accumulate_preprocessed_record(self, sample_state, preprocessed_record):
    return tf.nest.map_structure(tf.add, sample_state, preprocessed_record)

  def merge_sample_states(self, sample_state_1, sample_state_2):
    return tf.nest.map_structure(tf.add, sample_state_1, sample_state_2)

  def preprocess_records(self, params, records):
    """Vectorized preprocess_record over the leading (batch) axis of every leaf."""
    return tf.vectorized_map(lambda r: self.preprocess_record(params, r), records)

  def accumulate_records(self, params, sample_state, records, mask=None):
    """Clips each record of a batch (vectorized) and adds their sum to the state.

    `mask` is a float [B] vector of 0/1 weights: padded rows (mask 0) add nothing,
    which lets a Poisson sample be padded to a static shape.
    """
    pre = self.preprocess_records(params, records)

    def _sum(x):
      if mask is not None:
        m = tf.cast(mask, x.dtype)
        m = tf.reshape(m, [-1] + [1] * (len(x.shape) - 1))
        x = x * m
      return tf.reduce_sum(x, axis=0)

    return self.accumulate_preprocessed_record(
        sample_state, tf.nest.map_structure(_sum, pre))
