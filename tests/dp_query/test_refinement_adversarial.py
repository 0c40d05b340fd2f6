"""Adversarial checks of the shared exact-tail refinement (`randomness._shared_refined`, the
generator seen through its Philox state handle, `randomness._PhiloxState`): the words and the
generator state after each draw are exactly the generator's own (a twin generator drawing
through the public API) eagerly, in a graph and under XLA; the refinement branch really taken
under jit_compile=True gives the eager draw (to XLA's float32 rounding of the log) and the
same generator state; two generators sharing the one
function in a trace never advance each other; a generator of a distribution strategy (whose
key depends on the replica) never takes the shared function."""

import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.dp_query import randomness

# Nightly tier (-m slow): the shape x mode grids beyond a latin cover (each shape
# once, each of eager / graph / XLA at least once, XLA twice); two of the three refinement
# settings under XLA (97-2-2 stays).
SLOW_CASES = {
    "test_philox_state_draw_is_the_generators_own[shape0-dtype0-eager]",
    "test_uint32_words_are_the_generators_int64_draw_split[shape0-eager]",
    "test_philox_state_draw_is_the_generators_own[shape0-dtype0-graph]",
    "test_uint32_words_are_the_generators_int64_draw_split[shape0-xla]",
    "test_philox_state_draw_is_the_generators_own[shape1-dtype1-eager]",
    "test_uint32_words_are_the_generators_int64_draw_split[shape1-eager]",
    "test_uint32_words_are_the_generators_int64_draw_split[shape1-graph]",
    "test_philox_state_draw_is_the_generators_own[shape1-dtype1-xla]",
    "test_philox_state_draw_is_the_generators_own[shape2-dtype2-graph]",
    "test_uint32_words_are_the_generators_int64_draw_split[shape2-graph]",
    "test_philox_state_draw_is_the_generators_own[shape2-dtype2-xla]",
    "test_uint32_words_are_the_generators_int64_draw_split[shape2-xla]",
    "test_philox_state_draw_is_the_generators_own[shape3-dtype3-eager]",
    "test_uint32_words_are_the_generators_int64_draw_split[shape3-eager]",
    "test_philox_state_draw_is_the_generators_own[shape3-dtype3-graph]",
    "test_uint32_words_are_the_generators_int64_draw_split[shape3-graph]",
    "test_refinement_under_xla_equals_eager[600-4-3]",
    "test_refinement_under_xla_equals_eager[300-8-16]",
    # a second 2-D shape under XLA: [shape1-xla] stays (each mode keeps one shape by default)
    "test_uint32_words_are_the_generators_int64_draw_split[shape3-xla]"}

_PHILOX = tf.random.Algorithm.PHILOX.value


def _run(mode, fn):
  if mode == "eager":
    return fn()
  return tf.function(fn, jit_compile=(mode == "xla"))()


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("shape, dtype", [([7], tf.int64), ([3, 5], tf.uint32),
                                          ([1], tf.uint64), ([4, 1, 3], tf.int32)])
def test_philox_state_draw_is_the_generators_own(mode, shape, dtype):
  """Draw, then draw again: the words and the state after each draw equal a twin generator's
  `uniform_full_int` (the public API) in the same mode."""
  mine = tf.random.Generator.from_seed(1234, alg="philox")
  twin = tf.random.Generator.from_seed(1234, alg="philox")
  view = randomness._PhiloxState(mine.state.handle, _PHILOX)  # pylint: disable=protected-access
  for _ in range(2):
    got = _run(mode, lambda: view.uniform_full_int(shape, dtype))
    want = _run(mode, lambda: twin.uniform_full_int(shape, dtype))
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    np.testing.assert_array_equal(mine.state.numpy(), twin.state.numpy())
  # and the words were not all equal (a real draw)
  assert len(np.unique(got.numpy())) > 1 or int(np.prod(shape)) == 1


@pytest.mark.parametrize("size, bucket_bits, refine_below", [(600, 4, 3), (97, 2, 2),
                                                             (300, 8, 16)])
def test_refinement_under_xla_equals_eager(size, bucket_bits, refine_below):
  """Small buckets force the refinement branch (and its memoryless restarts) inside a
  jit_compile=True function: the values and the generator state equal the eager draw's."""
  eager_gen = tf.random.Generator.from_seed(77, alg="philox")
  xla_gen = tf.random.Generator.from_seed(77, alg="philox")
  k = randomness._bucket(  # pylint: disable=protected-access
      tf.constant(np.arange(size, dtype=np.uint32) * np.uint32(2654435761)), bucket_bits)
  assert float(tf.reduce_min(k)) < refine_below   # the branch is taken

  def draw(gen):
    return randomness.exponential(gen, size, bucket_bits, refine_below)

  fn = tf.function(lambda: draw(xla_gen), jit_compile=True)
  eager = np.concatenate([draw(eager_gen).numpy(), draw(eager_gen).numpy()])
  xla = np.concatenate([fn().numpy(), fn().numpy()])
  # XLA's CPU log may round 1 ulp differently from the eager kernel: same words, same values
  # to float32 rounding; the generator state (the words drawn) exactly the same
  np.testing.assert_allclose(xla, eager, rtol=4e-7, atol=0)
  np.testing.assert_array_equal(xla_gen.state.numpy(), eager_gen.state.numpy())
  # the refinement really ran: some values beyond the bucket grid's largest E
  assert np.max(eager) > bucket_bits * np.log(2.0) - np.log(refine_below)
  # crafted buckets straight into _log_uniform, jit: the shared call on a given k
  g1 = tf.random.Generator.from_seed(5, alg="philox")
  g2 = tf.random.Generator.from_seed(5, alg="philox")
  got = tf.function(lambda: randomness._log_uniform(  # pylint: disable=protected-access
      g1, k, bucket_bits, refine_below), jit_compile=True)()
  want = randomness._log_uniform(g2, k, bucket_bits, refine_below)  # pylint: disable=protected-access
  np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=4e-7, atol=0)
  np.testing.assert_array_equal(g1.state.numpy(), g2.state.numpy())
  assert not np.array_equal(g1.state.numpy(), tf.random.Generator.from_seed(
      5, alg="philox").state.numpy())   # the refinement drew words


@pytest.mark.parametrize("jit", [False, True])
def test_two_generators_in_one_trace_do_not_advance_each_other(jit):
  """Two generators (two optimizers' noise) drawing through the one shared function in the
  same graph, interleaved: each one's values and state equal its own eager draws alone."""
  args = (400, 4, 3)
  a, b = (tf.random.Generator.from_seed(s, alg="philox") for s in (1, 2))
  a_ref, b_ref = (tf.random.Generator.from_seed(s, alg="philox") for s in (1, 2))

  @tf.function(jit_compile=jit)
  def both():
    first = randomness.exponential(a, *args)
    second = randomness.exponential(b, *args)
    third = randomness.exponential(a, *args)
    return first, second, third

  first, second, third = both()
  want_a = [randomness.exponential(a_ref, *args).numpy() for _ in range(2)]
  want_b = randomness.exponential(b_ref, *args).numpy()
  close = dict(rtol=4e-7, atol=0)   # XLA's log: float32 rounding; the words exactly
  np.testing.assert_allclose(first.numpy(), want_a[0], **close)
  np.testing.assert_allclose(third.numpy(), want_a[1], **close)
  np.testing.assert_allclose(second.numpy(), want_b, **close)
  np.testing.assert_array_equal(a.state.numpy(), a_ref.state.numpy())
  np.testing.assert_array_equal(b.state.numpy(), b_ref.state.numpy())
  assert not np.array_equal(first.numpy(), third.numpy())   # noise never repeats


def test_strategy_generator_never_takes_the_shared_function():
  """A generator made under a MirroredStrategy (one CPU replica) folds the replica into its
  key, which the handle view would not: `_shared_refined` declines it, and a draw in the
  replica's trace equals the same generator's public draws (no shared call in the graph)."""
  strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
  with strategy.scope():
    gen = tf.random.Generator.from_seed(3, alg="philox")
  k = tf.zeros([8])
  seen = {}

  @tf.function
  def probe():
    seen["shared"] = randomness._shared_refined(gen, k, 8, 8, 4, 3)  # pylint: disable=protected-access
    return randomness.exponential(gen, 200, 4, 3)

  values = strategy.run(probe)
  assert seen["shared"] is None
  assert values.shape == (200,) and np.all(np.isfinite(values.numpy()))


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("shape", [[7], [2, 5], [1], [3, 4]])
def test_uint32_words_are_the_generators_int64_draw_split(mode, shape):
  """`_uint32_words` (its word count formed in Python for a static shape, by ops for a
  dynamic one): the first count 32-bit halves of ceil(count / 2) int64 draws of a twin
  generator, in order, and the same generator state."""
  count = int(np.prod(shape))
  for dynamic in (False, True):
    mine = tf.random.Generator.from_seed(99, alg="philox")
    twin = tf.random.Generator.from_seed(99, alg="philox")

    def words():
      dims = [tf.constant(d) for d in shape] if dynamic else shape
      return randomness._uint32_words(mine, dims)  # pylint: disable=protected-access

    def want():
      bits = twin.uniform_full_int([(count + 1) // 2], dtype=tf.int64)
      return tf.reshape(tf.reshape(tf.bitcast(bits, tf.uint32), [-1])[:count], shape)

    for _ in range(2):
      got = _run(mode, words)
      np.testing.assert_array_equal(got.numpy(), _run(mode, want).numpy())
      assert got.dtype == tf.uint32 and list(got.shape) == shape
      np.testing.assert_array_equal(mine.state.numpy(), twin.state.numpy())
