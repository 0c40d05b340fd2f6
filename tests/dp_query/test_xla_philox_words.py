"""randomness._philox_words: the Philox words drawn by an XLA-compiled function are TensorFlow's
kernel's, bit for bit, and so is the generator's state after them (the noise law and stream
unchanged; only the kernel that computes them)."""

import pytest
import tensorflow as tf

from tf_dpiter.dp_query import randomness

N = randomness.XLA_WORDS_FROM + 3   # odd: the draw's size is not a multiple of Philox's block


def _kernel_words(seed, count):
  """(the first draw, the next draw) of TensorFlow's own kernel, eagerly."""
  g = tf.random.Generator.from_seed(seed, alg="philox")
  return g.uniform_full_int([count], tf.int64), g.uniform_full_int([7], tf.int64)


def _must_compile_calls(fn):
  graph = fn.get_concrete_function().graph
  return [op for op in graph.get_operations()
          if op.type in ("PartitionedCall", "StatefulPartitionedCall")
          and op.node_def.attr["_XlaMustCompile"].b]


@pytest.mark.parametrize("outer_jit", [False, True])
def test_words_and_next_state_equal_the_kernel(outer_jit):
  g = tf.random.Generator.from_seed(11, alg="philox")

  @tf.function(jit_compile=outer_jit, autograph=False)
  def draw():
    return randomness._philox_words(g, N), g.uniform_full_int([7], tf.int64)

  if not outer_jit:   # the draw takes XLA's path in a plain graph
    assert len(_must_compile_calls(draw)) == 1
  words, after = draw()
  expected, expected_after = _kernel_words(11, N)
  assert words.shape == [N]
  assert bool(tf.reduce_all(words == expected))
  assert bool(tf.reduce_all(after == expected_after))


def test_small_and_eager_draws_take_the_kernel():
  g = tf.random.Generator.from_seed(3, alg="philox")

  @tf.function(autograph=False)
  def small():
    return randomness._philox_words(g, randomness.XLA_WORDS_FROM - 1)

  assert not _must_compile_calls(small)
  eager = randomness._philox_words(tf.random.Generator.from_seed(3, alg="philox"), N)
  assert bool(tf.reduce_all(eager == _kernel_words(3, N)[0]))


def test_box_muller_halves_bit_equal_to_the_kernel_path(monkeypatch):
  size = 4 * randomness.XLA_WORDS_FROM   # 2 x 2^17 words: XLA's path

  def halves(seed):
    g = tf.random.Generator.from_seed(seed, alg="philox")
    return tf.function(lambda: randomness.padded_normal_halves(g, size, 1.5),
                       autograph=False)()

  xla = halves(5)
  monkeypatch.setattr(randomness, "XLA_WORDS_FROM", 1 << 62)
  kernel = halves(5)
  for a, b in zip(xla, kernel):
    assert bool(tf.reduce_all(tf.bitcast(a, tf.int32) == tf.bitcast(b, tf.int32)))
