"""The DPQuery interface (McMahan et al. 2018, "A General Approach to Adding Differential
Privacy to Iterative Training Procedures", Section 7) and the sum-aggregation base class.

params = derive_sample_params(global_state); each record is clipped by preprocess_record and
summed into a sample state; sample states merge; get_noised_result returns the result, the next
global state and the privacy events (sum units) the ledger records. Graph- and XLA-compatible.

The per-record L2 clip (same paper, Section 2, flat clipping), the one place its arithmetic
lives: a record x (a nest read as one vector) becomes pi_S(x) = c * x, c = min(1, S / ||x||_2),
computed in float32 (float64 for a record with a float64 leaf). Every clipping path (preprocess_record, the ghost-norm path's
`record_clip_factors`, the correlated-noise queries) goes through the functions below.
"""

import abc
import collections
import functools

import tensorflow as tf

from tf_dpiter.dp_query import summation
from tf_dpiter.errors import ParameterValueError


# ---- the per-record L2 clip (module docstring) ----------------------------------------

# ||x|| below this is taken as this: ||x|| = 0 gives factor min(1, S / 1e-30) = 1 (S > 0).
_TINY_NORM = 1e-30


def float_dtype(*values):
  """The privacy arithmetic's dtype: tf.float64 if any tensor among `values` is float64, else
  tf.float32 (never less than float32; non-tensors count as float32)."""
  return (tf.float64 if any(tf.is_tensor(v) and v.dtype == tf.float64 for v in values)
          else tf.float32)


def _leaves(record):
  """(the record's leaves cast to the privacy arithmetic's dtype, that dtype)."""
  leaves = [tf.convert_to_tensor(x) for x in tf.nest.flatten(record)]
  dtype = float_dtype(*leaves)
  return [tf.cast(x, dtype) for x in leaves], dtype


def global_l2_norm(record):
  """||x||_2 of a nest of tensors as one vector, its squares summed in a pinned order
  (`summation.pinned_norm`): low by at most the factor 1 / (1 + `record_norm_margin(record)`).

  Args:
    record: a nest of numeric tensors.

  Returns:
    a scalar float32 (float64 if a leaf is float64) tensor.
  """
  leaves, dtype = _leaves(record)
  return summation.pinned_norm(leaves, dtype)[0]


def record_norm_margin(record):
  """eta_norm >= 0 of `global_l2_norm(record)`: `summation.norm_margin` of the leaves' entry
  counts in the norm's dtype (a Python float, or a float64 tensor when a leaf's size is
  known at run time only); the leaves need only .shape and .dtype."""
  leaves = tf.nest.flatten(record)
  wide = any(tf.as_dtype(getattr(x, "dtype", tf.float32)) == tf.float64 for x in leaves)
  sizes = []
  for x in leaves:
    shape = tf.TensorShape(x.shape)
    sizes.append(shape.num_elements() if shape.is_fully_defined() else tf.size(x))
  return summation.norm_margin(sizes, tf.float64 if wide else tf.float32)


def _raw_factors(norms, l2_norm_clip):
  """min(1, S / max(||x||, 1e-30)) in float32 (float64 norms: float64), no special case for
  a non-finite norm."""
  dtype = float_dtype(tf.convert_to_tensor(norms))
  clip = tf.cast(l2_norm_clip, dtype)
  return tf.minimum(tf.constant(1.0, dtype), clip / tf.maximum(tf.cast(norms, dtype), _TINY_NORM))


def clip_factors(record_norms, l2_norm_clip):
  """The clip factors c_i = min(1, S / ||g_i||_2) of records whose norms are known.

  A non-finite norm gets c_i = 0 (a function of that record alone: sensitivity stays S).

  Args:
    record_norms: ||g_i||_2 >= 0, a float tensor of any shape (e.g. [B], one per record).
    l2_norm_clip: S >= 0, a number or scalar tensor.

  Returns:
    a float32 tensor shaped like `record_norms`, each entry in [0, 1].
  """
  norms = tf.cast(record_norms, tf.float32)
  factors = _raw_factors(norms, l2_norm_clip)
  return tf.where(tf.math.is_finite(norms), factors, tf.zeros_like(factors))


def clip_by_global_l2_norm(record, l2_norm_clip):
  """pi_S(x) = x * min(1, S / ||x||_2) (McMahan et al. 2018, Section 1), over the whole nest,
  with S taken as S / (1 + eta_norm) (`summation.pinned_norm`): the computed norm may be
  low by that factor (`global_l2_norm`), and ||c x|| <= S must hold for the computed c.

  Args:
    record: a nest of float tensors x.
    l2_norm_clip: S >= 0, a number or scalar tensor.

  Returns:
    (clipped_record, norm_before_clipping): the clipped nest (same dtypes) and ||x||_2; a
    record of non-finite norm (a NaN or inf coordinate) is clipped to zeros (`scale_record`).
  """
  leaves, dtype = _leaves(record)
  norm, s = summation.pinned_norm(leaves, dtype)   # s: the norm's margin (1 / (1 + eta))
  clip = tf.cast(l2_norm_clip, dtype) * tf.cast(s, dtype)
  return scale_record(record, norm, _raw_factors(norm, clip)), norm


def clip_records_by_global_l2_norm(records, l2_norm_clip):
  """`clip_by_global_l2_norm` of every record of a batch at once (record i: index i of every
  leaf), by the same arithmetic as alone, without a per-record loop.

  Args:
    records: a nest of float tensors [B, ...] (B static or not, the same in every leaf).
    l2_norm_clip: S >= 0, a number or scalar tensor.

  Returns:
    (clipped records, norms [B]): the clipped nest (same dtypes) and each record's ||x_i||_2
    before clipping.
  """
  leaves, dtype = _leaves(records)
  if not leaves:
    return records, tf.zeros([0], dtype)
  sizes = []
  for x in leaves:
    shape = tf.TensorShape(x.shape)[1:]
    sizes.append(shape.num_elements() if shape.is_fully_defined()
                 else tf.reduce_prod(tf.shape(x)[1:]))
  norms = tf.sqrt(tf.add_n([summation.pinned_row_sums(tf.square(x)) for x in leaves]))
  shrink = summation.shrink(summation.norm_margin(sizes, dtype), dtype)
  factors = _raw_factors(norms, tf.cast(l2_norm_clip, dtype) * tf.cast(shrink, dtype))
  return scale_record(records, norms, factors), norms


def scale_record(record, norm, factor):
  """c x over the whole nest (`norm`, `factor`: scalars, or [B] for a batch), and zeros for a
  record of non-finite norm ||x||_2: one NaN/inf record would make the release non-finite
  (D and D + r told apart with certainty); zeros depend on that record alone (sensitivity S).
  """
  finite = tf.math.is_finite(norm)

  def scaled(x):
    x, c = tf.convert_to_tensor(x), factor
    if finite.shape.rank:   # a batch's [B]: as [B, 1, ...] against its leaf
      column = [-1] + [1] * (x.shape.rank - 1)
      return tf.where(tf.reshape(finite, column), x * tf.reshape(tf.cast(c, x.dtype), column),
                      tf.zeros_like(x))
    return tf.where(finite, x * tf.cast(c, x.dtype), tf.zeros_like(x))

  return tf.nest.map_structure(scaled, record)


# ---- the DPQuery interface ---------------------------------------------------------------


def zeros_like_template(template):
  """Zeros shaped like a record template (a nest of tensors, variables or `tf.TensorSpec`s)."""
  def _zeros(t):
    if isinstance(t, tf.TensorSpec):
      return tf.zeros(t.shape, t.dtype)
    t = tf.convert_to_tensor(t)
    return tf.zeros_like(t)
  return tf.nest.map_structure(_zeros, template)


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
    ParameterValueError: a structure does not match `shallow`.
  """
  if not _is_nest(shallow):
    return fn(*structures)
  if isinstance(shallow, dict):
    for s in structures:
      if not isinstance(s, dict) or set(s) != set(shallow):
        raise ParameterValueError(f"structure mismatch: expected keys {sorted(shallow)}, got {s!r}")
    return type(shallow)((k, map_up_to(shallow[k], fn, *(s[k] for s in structures)))
                         for k in sorted(shallow))  # tf.nest order
  for s in structures:
    if not _is_nest(s) or len(s) != len(shallow):
      raise ParameterValueError(f"structure mismatch: expected {len(shallow)} parts, got {s!r}")
  parts = [map_up_to(sh, fn, *(s[i] for s in structures)) for i, sh in enumerate(shallow)]
  return type(shallow)(*parts) if hasattr(shallow, "_fields") else type(shallow)(parts)


def flatten_up_to(shallow, structure):
  """The subtrees (a list) of `structure` at the leaves of the shallower nest `shallow`, in
  tf.nest.flatten order."""
  out = []
  map_up_to(shallow, lambda s: out.append(s), structure)
  return out


class DPQuery(metaclass=abc.ABCMeta):
  """Interface of a differentially private query over a sample of records."""

  def initial_global_state(self):
    """State carried from sample to sample (e.g. the current clip); default: ()."""
    return ()

  def derive_sample_params(self, global_state):
    """Parameters used to preprocess every record of one sample (e.g. the clip S).

    Args:
      global_state: the state from `initial_global_state` or the last `get_noised_result`.

    Returns:
      the sample's params (default: ()).
    """
    del global_state
    return ()

  @abc.abstractmethod
  def initial_sample_state(self, template):
    """Empty accumulator for a record shaped like `template`.

    Args:
      template: a nest of tensors, variables or `tf.TensorSpec`s shaped like one record.

    Returns:
      the empty sample state.
    """

  @abc.abstractmethod
  def preprocess_record(self, params, record):
    """Clips (or otherwise bounds) one record: the sensitivity of the sum comes from here.

    Args:
      params: this sample's parameters (`derive_sample_params`).
      record: a nest of tensors, one record (a per-record gradient).

    Returns:
      the preprocessed record.
    """

  def record_clip_factors(self, params, record_norms):
    """The factors c_i by which `preprocess_record` scales records of norms ||x_i|| (ghost norms).

    Args:
      params: this sample's parameters (`derive_sample_params`).
      record_norms: ||x_i||_2, a float tensor (e.g. [B], one per record).

    Returns:
      float32 factors shaped like `record_norms`.

    Raises:
      NotImplementedError: the query does not clip by a factor of the record's L2 norm.
    """
    del params, record_norms
    raise NotImplementedError(
        f"{type(self).__qualname__} does not clip records by a factor of their L2 norm "
        "(record_clip_factors is not implemented), so its clipping cannot be applied to "
        "norms computed elsewhere: clip each record with preprocess_record instead")

  @abc.abstractmethod
  def accumulate_preprocessed_record(self, sample_state, preprocessed_record):
    """Adds a preprocessed record into the sample state.

    Args:
      sample_state: the state so far.
      preprocessed_record: `preprocess_record`'s output.

    Returns:
      the new sample state.
    """

  def sample_state_of_sum(self, template, preprocessed_sum):
    """The sample state holding `preprocessed_sum`, a sum of preprocessed records formed
    elsewhere (the ghost-norm path's sum_i c_i x_i).

    Args:
      template: a nest of tensors, variables or `tf.TensorSpec`s shaped like one record.
      preprocessed_sum: a nest shaped like `template`, the sum of preprocessed records.

    Returns:
      the sample state.
    """
    return self.accumulate_preprocessed_record(self.initial_sample_state(template),
                                               preprocessed_sum)

  def accumulate_record(self, params, sample_state, record):
    """preprocess_record followed by accumulate_preprocessed_record.

    Args:
      params: the sample's params.
      sample_state: the state so far.
      record: one record.

    Returns:
      the new sample state.
    """
    return self.accumulate_preprocessed_record(
        sample_state, self.preprocess_record(params, record))

  def accumulate_records(self, params, sample_state, records, mask=None):
    """Accumulates a batch (leading axis of every leaf) record by record (a tf.while_loop).

    Args:
      params: the sample's params.
      sample_state: the state so far.
      records: a nest of [B, ...] tensors, record i at index i of every leaf.
      mask: optional [B] 0/1 vector (0: padding, skipped).

    Returns:
      the new sample state.
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
    """Combines two sample states (e.g. from two replicas).

    Args:
      sample_state_1: the sample state of some records.
      sample_state_2: the sample state of records disjoint from them.

    Returns:
      the state of their union.
    """

  @abc.abstractmethod
  def get_noised_result(self, sample_state, global_state):
    """Adds the noise and reports what was released.

    Args:
      sample_state: the accumulated (clipped) records.
      global_state: the current state.

    Returns:
      (result, new_global_state, events): the noised aggregate, the state for the next
      sample, and a tuple of privacy events in sum units (what the ledger records).
    """

  def derive_metrics(self, global_state):
    """Metrics derived from the global state (e.g. the current clip).

    Args:
      global_state: the query's global state.

    Returns:
      an OrderedDict of name -> tensor (default: empty).
    """
    del global_state
    return collections.OrderedDict()

  # ---- serialization (see tf_dpiter.dp_query.serialization) ---------------------------

  def get_config(self):
    """Constructor arguments as plain Python values (child queries serialized)."""
    if type(self).__init__ is object.__init__:
      return {}
    raise NotImplementedError(
        f"{type(self).__qualname__}.get_config() is not implemented: return the constructor "
        "arguments as plain Python values (child queries through "
        "tf_dpiter.dp_query.serialize) to make this query serializable")

  @classmethod
  def from_config(cls, config):
    """The query built from `get_config()`'s output: cls(**config) by default.

    Args:
      config: a dict from `get_config`.

    Returns:
      the query.
    """
    return cls(**config)


def forwarded(name, inner):
  """A wrapper query's DPQuery method `name` (to bind in its class) that calls the one of the
  query held in its attribute `inner` (DPQuery's docstring)."""
  # updated=(): the method is concrete even where DPQuery's is abstract (no __dict__ copied)
  @functools.wraps(getattr(DPQuery, name), updated=())
  def method(self, *args, **kwargs):
    return getattr(getattr(self, inner), name)(*args, **kwargs)
  return method


def gives_clip_factors(query):
  """True if `query` implements `record_clip_factors` and no class below the implementing one
  redefines `preprocess_record` (which would make the factors clip by another rule).

  Args:
    query: a DPQuery instance.

  Returns:
    bool.
  """
  mro = type(query).__mro__

  def owner(name):
    return next((cls for cls in mro if name in vars(cls)), DPQuery)

  factors_owner = owner("record_clip_factors")
  if factors_owner is DPQuery:
    return False
  return mro.index(owner("preprocess_record")) >= mro.index(factors_owner)


class SumAggregationDPQuery(DPQuery):
  """A DPQuery whose sample state is the plain sum of preprocessed records."""

  def initial_sample_state(self, template):
    return zeros_like_template(template)

  def accumulate_preprocessed_record(self, sample_state, preprocessed_record):
    return tf.nest.map_structure(tf.add, sample_state, preprocessed_record)

  def sample_state_of_sum(self, template, preprocessed_sum):
    """DPQuery.sample_state_of_sum: the sum itself cast to the template's dtypes (if this
    class keeps SumAggregationDPQuery's state; otherwise DPQuery's default).

    Args:
      template: a nest of tensors, variables or `tf.TensorSpec`s shaped like one record.
      preprocessed_sum: a nest shaped like `template`.

    Returns:
      the sample state.
    """
    cls = type(self)
    if (cls.initial_sample_state is not SumAggregationDPQuery.initial_sample_state
        or cls.accumulate_preprocessed_record is not
        SumAggregationDPQuery.accumulate_preprocessed_record):
      return super().sample_state_of_sum(template, preprocessed_sum)
    tf.nest.assert_same_structure(template, preprocessed_sum)
    return tf.nest.map_structure(lambda t, s: tf.cast(s, t.dtype), template, preprocessed_sum)

  def merge_sample_states(self, sample_state_1, sample_state_2):
    return tf.nest.map_structure(tf.add, sample_state_1, sample_state_2)

  def preprocess_records(self, params, records):
    """Vectorized preprocess_record over the leading (batch) axis of every leaf.

    Args:
      params: the sample's params.
      records: a nest of [B, ...] tensors.

    Returns:
      the preprocessed records, [B, ...] leaves.
    """
    return tf.vectorized_map(lambda r: self.preprocess_record(params, r), records)

  def accumulate_records(self, params, sample_state, records, mask=None):
    """Clips each record of a batch (vectorized) and adds their sum to the state, summed in a
    pinned order (`summation.pairwise_sums`; `summation.rounding_margin` bounds the sum's move
    when one record is added or removed).

    Args:
      params: the sample's params.
      sample_state: the state so far.
      records: a nest of [B, ...] tensors.
      mask: optional [B] weights (0: a padding row, adds nothing; the Keras step passes
        mask times its public scale and `summation.shrink`).

    Returns:
      the new sample state.
    """
    pre = self.preprocess_records(params, records)

    if mask is not None:
      pre = tf.nest.map_structure(
          lambda x: x * tf.reshape(tf.cast(mask, x.dtype), [-1] + [1] * (x.shape.rank - 1)),
          pre)
    return self.accumulate_preprocessed_record(
        sample_state, tf.nest.pack_sequence_as(
            pre, summation.pairwise_sums(tf.nest.flatten(pre))))
