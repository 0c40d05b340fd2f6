"""Gaussian sum query (McMahan et al. 2018, Section 1): records clipped to L2 norm S, the sum
plus N(0, sigma^2 I), sigma = z S (computed only in `gaussian_stddev`)."""

import collections
import numbers

import tensorflow as tf

from tf_dpiter import validation
from tf_dpiter.dp_query import dp_query
from tf_dpiter.dp_query import events as events_lib
from tf_dpiter.dp_query import randomness
from tf_dpiter.dp_query import serialization


def gaussian_stddev(l2_norm_clip, noise_multiplier, validate=True):
  """sigma = z * S, the noise standard deviation (sum units) of a Gaussian sum query.

  McMahan et al., "A General Approach to Adding Differential Privacy to Iterative Training
  Procedures", Section 1. z = 0 gives sigma = 0 (also for S = +inf).

  Args:
    l2_norm_clip: S > 0 (+inf allowed with z = 0); a number or a float tensor.
    noise_multiplier: z >= 0, finite; a number or a float tensor.
    validate: False when S and z were validated already (a `DPConfig`'s).

  Returns:
    sigma: a Python float for numbers, else a float32 (float64 if an input is) tensor.

  Raises:
    ParameterTypeError: an argument is not a number.
    PrivacyConfigError: S <= 0 or NaN, z < 0, NaN or inf, or S = inf with z > 0.
  """
  z, clip = noise_multiplier, l2_norm_clip
  if validate:
    z = validation.check_nonnegative("noise_multiplier", noise_multiplier, allow_inf=False)
    clip = validation.check_clip_norm("l2_norm_clip", l2_norm_clip,
                                      noise_multiplier=None if tf.is_tensor(z) else z)
  if tf.is_tensor(clip) or tf.is_tensor(z) or isinstance(clip, tf.Variable) or isinstance(
      z, tf.Variable):
    dtype = dp_query.float_dtype(clip, z)
    clip, z = tf.cast(clip, dtype), tf.cast(z, dtype)
    return tf.where(tf.equal(z, 0.0), tf.zeros_like(z * clip), z * clip)
  clip, z = float(clip), float(z)
  return 0.0 if z == 0.0 else z * clip


# Values drawn at once when a leaf is noised in place: a larger leaf is noised block by
# block, so the draw's temporaries (its 32-bit words and the Box-Muller terms, about 4 values
# each per noise value) stay near 64 MiB whatever the leaf's size.
BLOCK_VALUES = 1 << 22


def add_gaussian_noise(generator, structure, stddev):
  """structure + N(0, stddev^2) per coordinate, drawn from `generator`, in bounded draws.

  Noise and addition are in float32 (float64 leaves: float64) whatever the leaf dtype, so a
  16-bit sum gets exactly sigma; the result is cast back (post-processing). The static float32
  leaves (sizes multiple of 16 first: their slices are views) form one stream noised by
  consecutive draws of `BLOCK_VALUES` values: leaf i takes values [o_i, o_i + size_i), so no
  value serves twice. A leaf of at most BLOCK_VALUES across two draws gets its two parts joined
  (a copy of at most a block) and one addition; a larger leaf is noised block by block in its
  own buffer (`TensorStridedSliceUpdate`, whose strided write costs more per value than the
  join's copy). Draws run in sequence: memory O(sum + block). `generator`: a
  tf.random.Generator or `randomness.SecureRandom`; `stddev` sigma >= 0 in sum units.
  """
  leaves = [tf.convert_to_tensor(v) for v in tf.nest.flatten(structure)]
  out = list(leaves)
  streamed = [i for i, leaf in enumerate(leaves)
              if _wide(leaf.dtype) == tf.float32 and isinstance(_size(leaf), int)
              and _size(leaf) > 0]
  streamed.sort(key=lambda i: _size(leaves[i]) % 16 != 0)   # stable: aligned offsets first
  previous = _noised_stream(generator, leaves, streamed, stddev, out)
  chosen = set(streamed)
  for i, leaf in enumerate(leaves):
    if i in chosen:
      continue
    with tf.control_dependencies(previous):
      out[i] = _noised_leaf(generator, leaf, stddev)
    previous = [out[i]]
  return tf.nest.pack_sequence_as(structure, out)


def _wide(dtype):
  """float64 for float64 leaves, else float32 (the dtype of the noise arithmetic)."""
  return tf.float64 if dtype == tf.float64 else tf.float32


def _noised_stream(generator, leaves, order, stddev, out):
  """Noises leaves[i] for i in `order` (float32 arithmetic, static sizes) from one stream of
  draws of BLOCK_VALUES values (`add_gaussian_noise`); writes the noised leaves into `out`.

  Returns:
    the tensors the last draw wrote (the next draw waits for them).
  """
  sizes = [_size(leaves[i]) for i in order]
  total = sum(sizes)
  block = int(BLOCK_VALUES)
  if tf.executing_eagerly():
    draw_full = lambda: _noise(generator, block, tf.float32, stddev)  # noqa: E731
  else:   # one function for every full draw, never inlined: its branch and loops once in
    # the graph TensorFlow optimizes and runs (inlined, BERT-base's 26 draws were 9,000 nodes)
    draw_full = tf.function(lambda: _noise(generator, block, tf.float32, stddev),
                            autograph=False, experimental_attributes={"_noinline": True})
  flats = {}
  offsets, o = [], 0
  for n in sizes:
    offsets.append(o)
    o += n
  previous, first = [], 0   # first: the first leaf (in `order`) not fully noised yet
  shapes = {}   # one shape constant per distinct leaf shape
  held = {}   # leaf -> the noise of its first part (a leaf of at most a block across 2 draws)
  for start in range(0, total, block):
    n = min(block, total - start)
    with tf.control_dependencies(previous):
      halves = draw_full() if n == block else _noise(generator, n, tf.float32, stddev)
    previous = []
    spans = []   # (j, lo, hi): leaf order[j] takes stream values [lo, hi) of this draw
    j = first
    while j < len(order) and offsets[j] < start + n:
      lo, hi = max(offsets[j], start), min(offsets[j] + sizes[j], start + n)
      spans.append((j, lo, hi))
      j += 1
    pieces = _stream_pieces(halves, [(lo - start, hi - start) for _, lo, hi in spans])
    for (j, lo, hi), piece in zip(spans, pieces):
      i, a, size = order[j], offsets[j], sizes[j]
      if size <= block and lo > a:   # its second part (the leaf was across two draws):
        piece = tf.concat([held.pop(i), piece], 0)   # joined to the first, at most a block
      elif size <= block and hi < a + size:   # its first part: held for the next draw
        held[i] = piece
        continue
      if size <= block:   # the whole leaf's noise: one addition, the noise viewed in the
        shape = leaves[i].shape   # leaf's (static) shape (a 1-D leaf takes it as it is)
        if shape.rank != 1:
          key = tuple(shape.as_list())
          if key not in shapes:
            shapes[key] = tf.constant(key, tf.int32)
          piece = tf.reshape(piece, shapes[key])
        noised = tf.cast(leaves[i], tf.float32) + piece
        previous.append(noised)
        out[i] = tf.cast(noised, leaves[i].dtype)
        first = j + 1
        continue
      if i not in flats:   # larger than a block: into its own buffer, block by block
        flats[i] = tf.reshape(tf.cast(leaves[i], tf.float32), [-1])
      flats[i] = tf.raw_ops.TensorStridedSliceUpdate(
          input=flats[i], begin=[lo - a], end=[hi - a], strides=[1],
          value=flats[i][lo - a:hi - a] + piece)
      previous.append(flats[i])
      if hi == a + size:   # done: back to the leaf's shape and dtype
        out[i] = tf.cast(tf.reshape(flats[i], tf.shape(leaves[i])), leaves[i].dtype)
        first = j + 1
  return previous


# Stream offsets that are multiples of this many float32 values start a piece at a 64-byte
# boundary: TensorFlow's CPU split and slice kernels then return a view of the draw's buffer
# (an unaligned cut copies; a split copies every output if one cut is unaligned).
_ALIGNED_VALUES = 16


def _stream_pieces(halves, spans):
  """The values [lo, hi) of one draw (its two float32 halves [m], m static and a multiple of
  16: value v is halves[0][v] below m, else halves[1][v - m]) for each of the consecutive
  `spans` (0 <= lo < hi <= 2m, the first lo 0), cut by one split per half at aligned points."""
  m = int(halves[0].shape[0])
  parts = []   # per half: the spans' parts (lo, hi) in half coordinates
  for h, (h_lo, h_hi) in enumerate(((0, m), (m, 2 * m))):
    parts.append([(max(lo, h_lo) - h_lo, min(hi, h_hi) - h_lo) for lo, hi in spans
                  if lo < h_hi and hi > h_lo])
  cut = []   # per half: {aligned cut point: segment tensor starting there}
  for h, half_parts in enumerate(parts):
    points = sorted({p for lo, hi in half_parts for p in (lo, hi)
                     if 0 < p < m and p % _ALIGNED_VALUES == 0} | {0, m})
    if len(points) == 2:
      cut.append(([0], [halves[h]]))
      continue
    sizes = [b - a for a, b in zip(points[:-1], points[1:])]
    cut.append((points[:-1], tf.split(halves[h], sizes, 0)))

  def part(h, lo, hi):   # values [lo, hi) of half h
    starts, segments = cut[h]
    k = max(i for i, s in enumerate(starts) if s <= lo)
    seg = segments[k]
    if lo == starts[k] and hi - lo == int(seg.shape[0]):
      return seg
    return tf.slice(seg, [lo - starts[k]], [hi - lo])   # off the alignment: a copy

  out = []
  for lo, hi in spans:
    if hi <= m:
      out.append(part(0, lo, hi))
    elif lo >= m:
      out.append(part(1, lo - m, hi - m))
    else:
      out.append(tf.concat([part(0, lo, m), part(1, 0, hi - m)], 0))
  return out


def _noised_leaf(generator, leaf, stddev):
  """leaf + N(0, stddev^2 I) in the privacy dtype, cast back to leaf.dtype
  (`add_gaussian_noise`: in blocks of BLOCK_VALUES values for a large static leaf)."""
  dtype = _wide(leaf.dtype)
  size = _size(leaf)
  wide = tf.cast(leaf, dtype)
  if not isinstance(size, int) or size <= BLOCK_VALUES:
    noise = _joined(_noise(generator, size, dtype, stddev))[:size]
    return tf.cast(wide + tf.reshape(noise, tf.shape(leaf)), leaf.dtype)
  flat = tf.reshape(wide, [-1])
  for start in range(0, size, BLOCK_VALUES):
    stop = min(start + BLOCK_VALUES, size)
    with tf.control_dependencies([flat]):   # one block's draw alive at a time
      noise = _joined(_noise(generator, stop - start, dtype, stddev))[:stop - start]
    flat = tf.raw_ops.TensorStridedSliceUpdate(
        input=flat, begin=[start], end=[stop], strides=[1], value=flat[start:stop] + noise)
  return tf.cast(tf.reshape(flat, tf.shape(leaf)), leaf.dtype)


def _size(tensor):
  """The number of entries of `tensor`: a Python int when static, else an int32 tensor."""
  size = tensor.shape.num_elements()
  return size if size is not None else tf.size(tensor)


def _noise(generator, size, dtype, stddev):
  """At least `size` i.i.d. N(0, stddev^2) values of `dtype`, as a tuple of 1-D parts whose
  concatenation is the values (float32: the Box-Muller draw's two halves with sigma folded
  into its radius, `randomness.padded_normal_halves`; float64: one part,
  `randomness.normal` times sigma)."""
  if dtype == tf.float64:
    return (randomness.normal(generator, [size], dtype=dtype) * tf.cast(stddev, dtype),)
  return tuple(randomness.padded_normal_halves(generator, size, stddev))


def _joined(parts):
  """The values of `_noise`'s parts as one tensor (a copy only when there are two)."""
  return parts[0] if len(parts) == 1 else tf.concat(parts, 0)


def adds_scaled_noise(query):
  """True if `query`'s noised result and sample state are `GaussianSumQuery`'s (so that
  `get_scaled_noised_result` is valid for it)."""
  cls = type(query)
  return (isinstance(query, GaussianSumQuery)
          and cls.get_noised_result is GaussianSumQuery.get_noised_result
          and cls.get_scaled_noised_result is GaussianSumQuery.get_scaled_noised_result
          and cls.initial_sample_state is dp_query.SumAggregationDPQuery.initial_sample_state
          and cls.accumulate_preprocessed_record is
          dp_query.SumAggregationDPQuery.accumulate_preprocessed_record)


# Each argument of GaussianSumQuery alone (`validation.check_params`).
GAUSSIAN_SUM_CONSTRAINTS = {
    "l2_norm_clip": validation.Interval(float, 0, None, closed="neither", allow_inf=True),
    "stddev": validation.Interval(float, 0, None, closed="left"),
}


@serialization.register_query()
@validation.validates(GAUSSIAN_SUM_CONSTRAINTS)
class GaussianSumQuery(dp_query.SumAggregationDPQuery):
  """Sum of records clipped to `l2_norm_clip`, plus N(0, stddev^2) noise per coordinate."""

  _GlobalState = collections.namedtuple("_GlobalState", ["l2_norm_clip", "stddev"])

  def __init__(self, l2_norm_clip, stddev, seed=None, secure_mode=False):
    """Builds the query from its privacy tuple (S, sigma).

    Args:
      l2_norm_clip: S > 0 (+inf: no clipping), the per-record L2 bound.
      stddev: sigma >= 0, finite, the noise standard deviation in sum units (sigma = z S:
        build from a noise multiplier with `from_noise_multiplier`).
      seed: fixes the noise (tests only: the output is then not private).
      secure_mode: noise from os.urandom, sum of two draws (`randomness.SecureRandom`).

    Raises:
      ParameterTypeError: a non-numeric S or sigma.
      PrivacyConfigError: S <= 0 or NaN, sigma < 0 or infinite, or a seed with secure_mode.
    """
    self._l2_norm_clip = l2_norm_clip
    keep = tf.is_tensor(stddev) or isinstance(stddev, (numbers.Real, tf.Variable))
    self._stddev = stddev if keep else float(stddev)   # e.g. a 0-d array: a float
    self._seed = seed
    self._secure_mode = bool(secure_mode)
    self._generator = randomness.make_generator(seed, secure=self._secure_mode)

  @classmethod
  def from_noise_multiplier(cls, l2_norm_clip, noise_multiplier, seed=None, secure_mode=False):
    """The query with clip S and noise sigma = `gaussian_stddev(S, z)`.

    Args:
      l2_norm_clip: S > 0 (+inf only with z = 0).
      noise_multiplier: z >= 0, finite (0: no noise).
      seed: as in the constructor.
      secure_mode: as in the constructor.

    Returns:
      a GaussianSumQuery.

    Raises:
      PrivacyConfigError: see `gaussian_stddev`.
    """
    return cls(l2_norm_clip, gaussian_stddev(l2_norm_clip, noise_multiplier), seed=seed,
               secure_mode=secure_mode)

  @property
  def noise_generator(self):
    """The noise's random source: a `tf.random.Generator`, or `randomness.SecureRandom`."""
    return self._generator

  def get_config(self):
    """DPQuery.get_config: {l2_norm_clip, stddev, seed, secure_mode} as plain values."""
    p = serialization.plain
    return {"l2_norm_clip": p(self._l2_norm_clip), "stddev": p(self._stddev),
            "seed": p(self._seed), "secure_mode": self._secure_mode}

  @property
  def l2_norm_clip(self):
    """S, the per-record L2 clip (a number, or a tensor when built with one)."""
    return self._l2_norm_clip

  @property
  def stddev(self):
    """sigma, the noise standard deviation of the sum (sum units)."""
    return self._stddev

  def make_global_state(self, l2_norm_clip, stddev):
    """The global state (S, sigma) as float32 tensors, e.g. to change them between samples.

    Args:
      l2_norm_clip: S.
      stddev: sigma (sum units).

    Returns:
      the query's global state namedtuple.
    """
    return self._GlobalState(tf.cast(l2_norm_clip, tf.float32), tf.cast(stddev, tf.float32))

  def initial_global_state(self):
    """DPQuery.initial_global_state: (S, sigma) as float32 tensors."""
    return self.make_global_state(self._l2_norm_clip, self._stddev)

  def derive_sample_params(self, global_state):
    """DPQuery.derive_sample_params: the clip S of this sample.

    Args:
      global_state: the query's global state.
    """
    return global_state.l2_norm_clip

  def preprocess_record(self, params, record):
    """pi_S(record) = record * min(1, S / ||record||_2) (`dp_query.clip_by_global_l2_norm`).

    Args:
      params: S, from `derive_sample_params`.
      record: a nest of float tensors.

    Returns:
      the clipped record (same structure and dtypes).
    """
    clipped, _ = dp_query.clip_by_global_l2_norm(record, params)
    return clipped

  def preprocess_records(self, params, records):
    """DPQuery.preprocess_records: every record clipped at once
    (`dp_query.clip_records_by_global_l2_norm`: `preprocess_record`'s arithmetic per record,
    no per-record vectorization); a subclass with a `preprocess_record` of its own: its
    records one by one (DPQuery's).

    Args:
      params: S, from `derive_sample_params`.
      records: a nest of float tensors [B, ...].

    Returns:
      the clipped records (same structure and dtypes).
    """
    if type(self).preprocess_record is not GaussianSumQuery.preprocess_record:
      return super().preprocess_records(params, records)
    return dp_query.clip_records_by_global_l2_norm(records, params)[0]

  def record_clip_factors(self, params, record_norms):
    """c_i = min(1, S / ||x_i||_2), 0 for a non-finite norm (`dp_query.clip_factors`).

    Args:
      params: S, from `derive_sample_params`.
      record_norms: ||x_i||_2, a float tensor.

    Returns:
      float32 factors shaped like `record_norms`.
    """
    return dp_query.clip_factors(record_norms, params)

  def get_noised_result(self, sample_state, global_state):
    """(sum + N(0, sigma^2), global_state, (GaussianSumEvent(S, sigma),)).

    Args:
      sample_state: the clipped sum.
      global_state: (S, sigma).

    Returns:
      (noised sum, the unchanged global state, a one-event tuple in sum units).
    """
    result = add_gaussian_noise(self._generator, sample_state, global_state.stddev)
    event = events_lib.GaussianSumEvent(global_state.l2_norm_clip, global_state.stddev)
    return result, global_state, (event,)

  def get_scaled_noised_result(self, scaled_sum, global_state, scale):
    """`get_noised_result` of a sum formed already multiplied by a public `scale` a:
    a (sum + N(0, sigma^2 I)) = a sum + N(0, (a sigma)^2 I); the event stays (S, sigma).

    Args:
      scaled_sum: a * the clipped sum (the sample state times `scale`).
      global_state: (S, sigma).
      scale: a > 0, finite, public (a float32 scalar tensor or a number), e.g.
        1 / denominator.

    Returns:
      (a (sum + noise), the unchanged global state, (GaussianSumEvent(S, sigma),)).
    """
    stddev = tf.cast(global_state.stddev, tf.float32) * tf.cast(scale, tf.float32)
    result = add_gaussian_noise(self._generator, scaled_sum, stddev)
    event = events_lib.GaussianSumEvent(global_state.l2_norm_clip, global_state.stddev)
    return result, global_state, (event,)

  def derive_metrics(self, global_state):
    """DPQuery.derive_metrics: {l2_norm_clip, stddev}.

    Args:
      global_state: the query's global state.
    """
    return collections.OrderedDict(l2_norm_clip=global_state.l2_norm_clip,
                                   stddev=global_state.stddev)
