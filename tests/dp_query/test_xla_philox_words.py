"""randomness._philox_words: the Philox words drawn by the process's one XLA-compiled block draw.

A draw of count words (XLA_WORDS_FROM <= count <= XLA_BLOCK_WORDS, static, in a graph) takes a
whole block of XLA_BLOCK_WORDS words and uses its first count: those are TensorFlow's kernel's
words bit for bit, and the generator's state moves by the whole block, as the kernel's draw of
a block moves it; the discarded words are never used by a later draw. One compiled function
serves every trace and generator. The Gaussian law is unchanged (KS), in a graph and under
jit_compile=True, and a rolled-back or restored fit step draws fresh noise through it.
"""

import math

import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

from tf_dpiter.dp_query import randomness
from tests.privacy import test_rollback_noise as rollback

BLOCK = randomness.XLA_BLOCK_WORDS
TAIL = randomness.XLA_WORDS_FROM + 3   # odd: not a multiple of Philox's 128-bit output


def _kernel_blocks(seed, blocks):
  """`blocks` consecutive draws of BLOCK words by TensorFlow's kernel, eagerly, and 7 more
  words."""
  g = tf.random.Generator.from_seed(seed, alg="philox")
  draws = [g.uniform_full_int([BLOCK], tf.int64).numpy() for _ in range(blocks)]
  return draws, g.uniform_full_int([7], tf.int64).numpy()


def _must_compile_calls(fn):
  graph = fn.get_concrete_function().graph
  return [op for op in graph.get_operations()
          if op.type in ("PartitionedCall", "StatefulPartitionedCall")
          and op.node_def.attr["_XlaMustCompile"].b]


def _counting(monkeypatch):
  """Counts the traced calls of the compiled block draw (the wrapper passes everything on)."""
  calls = []
  real = randomness._compiled_block

  def wrapper(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)

  monkeypatch.setattr(randomness, "_compiled_block", wrapper)
  return calls


@pytest.mark.parametrize("outer_jit", [False, True])
def test_words_are_the_kernels_and_the_state_moves_by_whole_blocks(outer_jit):
  """A tail draw, a full block, a tail again, then 7 kernel words: each draw is the prefix of
  the kernel's block at that position, and the 7 words follow the third block (the discarded
  words are skipped, never drawn again)."""
  g = tf.random.Generator.from_seed(11, alg="philox")

  @tf.function(jit_compile=outer_jit, autograph=False)
  def draw():
    a = randomness._philox_words(g, TAIL)
    with tf.control_dependencies([a]):
      b = randomness._philox_words(g, BLOCK)
    with tf.control_dependencies([b]):
      c = randomness._philox_words(g, TAIL)
    with tf.control_dependencies([c]):
      return a, b, c, g.uniform_full_int([7], tf.int64)

  if not outer_jit:   # the draws call the compiled function in a plain graph
    assert len(_must_compile_calls(draw)) == 3
  a, b, c, after = [t.numpy() for t in draw()]
  blocks, kernel_after = _kernel_blocks(11, 3)
  assert a.shape == (TAIL,) and b.shape == (BLOCK,) and c.shape == (TAIL,)
  np.testing.assert_array_equal(a, blocks[0][:TAIL])
  np.testing.assert_array_equal(b, blocks[1])
  np.testing.assert_array_equal(c, blocks[2][:TAIL])
  np.testing.assert_array_equal(after, kernel_after)
  # the stream never repeats a word: each block's first and last 2^12 words (the last ones
  # discarded by the tail draws) and the words after them are all distinct
  every = np.concatenate([w for blk in blocks for w in (blk[:4096], blk[-4096:])] + [after])
  assert len(np.unique(every)) == every.size


def test_one_compiled_function_for_every_trace_and_generator():
  """Two generators, two traces, full and tail draws: every call is of the same function
  (XLA's compilation cache is keyed by it, so it is compiled once per process)."""
  names = set()
  for seed in (1, 2):
    g = tf.random.Generator.from_seed(seed, alg="philox")
    fn = tf.function(lambda: (randomness._philox_words(g, BLOCK),  # pylint: disable=cell-var-from-loop
                              randomness._philox_words(g, TAIL)), autograph=False)
    calls = _must_compile_calls(fn)
    assert len(calls) == 2
    names |= {op.get_attr("f").name for op in calls}
  assert len(names) == 1


def test_small_dynamic_and_eager_draws_take_the_kernel():
  g = tf.random.Generator.from_seed(3, alg="philox")
  small = tf.function(lambda: randomness._philox_words(g, randomness.XLA_WORDS_FROM - 1),
                      autograph=False)
  large = tf.function(lambda: randomness._philox_words(g, BLOCK + 1), autograph=False)
  dynamic = tf.function(lambda n: randomness._philox_words(g, n), autograph=False,
                        input_signature=[tf.TensorSpec([], tf.int32)])
  assert not (_must_compile_calls(small) or _must_compile_calls(large)
              or _must_compile_calls(dynamic))
  eager = randomness._philox_words(tf.random.Generator.from_seed(3, alg="philox"), TAIL)
  twin = tf.random.Generator.from_seed(3, alg="philox")
  np.testing.assert_array_equal(eager.numpy(), twin.uniform_full_int([TAIL], tf.int64).numpy())


def test_a_full_noise_draw_is_bit_equal_to_the_kernel_path(monkeypatch):
  """padded_normal_halves of one full block's values (2 x 2^21 32-bit words): the same bits
  as with TensorFlow's kernel, and the same generator state after."""
  size = 4 * BLOCK

  def halves(seed):
    g = tf.random.Generator.from_seed(seed, alg="philox")
    out = tf.function(lambda: randomness.padded_normal_halves(g, size, 1.5),
                      autograph=False)()
    return out, g.state.numpy()

  (xla, state), calls = halves(5), _counting(monkeypatch)
  monkeypatch.setattr(randomness, "XLA_WORDS_FROM", 1 << 62)
  kernel, kernel_state = halves(5)
  assert not calls   # the second draw took the kernel
  for a, b in zip(xla, kernel):
    np.testing.assert_array_equal(tf.bitcast(a, tf.int32).numpy(), tf.bitcast(b, tf.int32).numpy())
  np.testing.assert_array_equal(state, kernel_state)


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_gaussian_law_through_a_tail_block(mode, monkeypatch):
  """N(0, sigma^2) values from a draw whose words are a block's prefix: KS at level 0.001
  (critical value 1.95 / sqrt(N)) and the standard deviation within 5 standard errors."""
  calls = _counting(monkeypatch)
  size, sigma = 2 * randomness.XLA_WORDS_FROM + 101, 2.5
  g = tf.random.Generator.from_seed(21, alg="philox")
  z = tf.function(lambda: randomness.padded_normal(g, size, sigma), autograph=False,
                  jit_compile=(mode == "xla"))().numpy().astype(np.float64)
  assert calls   # the draw's words came from the compiled block
  assert z.size >= size and np.all(np.isfinite(z))
  assert stats.kstest(z / sigma, "norm").statistic < 1.95 / math.sqrt(z.size)
  assert abs(z.std() - sigma) < 5 * sigma * math.sqrt(2.0 / z.size)


@pytest.mark.parametrize("compiled_draw", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_rolled_back_steps_draw_fresh_noise_through_tail_blocks(compiled_draw, monkeypatch,
                                                                tmp_path):
  """The fit step's noise through blocks of 2^13 words (the model's 12,040 values: 6,032 words
  of a block, the rest discarded): a checkpoint restore, load_weights and an iterations rollback
  each retake a step whose noise is independent of the step it replaces, every step charged
  (tests/privacy/test_rollback_noise.py's checks)."""
  monkeypatch.setattr(randomness, "XLA_BLOCK_WORDS", 1 << 13)
  monkeypatch.setattr(randomness, "XLA_WORDS_FROM", 1 << 10)
  calls = _counting(monkeypatch)
  model, opt = rollback._model(compiled_draw)  # pylint: disable=protected-access
  x, y = rollback._data()  # pylint: disable=protected-access
  released = 0
  for path in ("checkpoint", "load_weights", "iterations_assign"):
    first, second, count = rollback._rollback_updates(  # pylint: disable=protected-access
        path, model, x, y, tmp_path)
    released += count
    rollback._assert_fresh_and_charged(  # pylint: disable=protected-access
        model, opt, compiled_draw, path, first, second, released)
  assert calls   # the step's noise went through the compiled block
