"""Padded Poisson samples under XLA: the padding tail is skipped, the step stays exact.

Under jit_compile=True a Poisson sample is padded to a static size; chunking.chunk_layout
splits it into a first chunk of E records (E = q n, the expected sample
size) and a tail of small chunks run in a loop up to the last real record. With noise 0 the update must be
-lr * sum_i clip(g_i) / E over the real examples (add/remove one example, Poisson: the
denominator is the public E) whether the tail ran or not; the chunk count is checked on a
counting chunk function.
"""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpiter.data import python_source
import tf_dpiter as dp
from tests.keras import dp_keras_helpers as helpers
from tf_dpiter.keras.optimizer import chunking

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CLIP, N, E, M = 0.05, 1000, 16, 48     # first chunk: ceil(16 / 8) * 8 = 16 records, tail chunks of 8


def _model(clipping, physical=None):
  keras.utils.set_random_seed(1)
  model = dp.keras.DPSequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                                 keras.layers.Dense(3)])
  model.compile(optimizer=dp.keras.DPKerasSGDOptimizer(
      CLIP, 0.0, learning_rate=1.0, clipping=clipping, max_physical_batch_size=physical),
                loss=LOSS, jit_compile=True)
  model.optimizer.set_sampling(N, E / N, "poisson", E)
  return model


def _one_step(model, x, y, w, dynamic):
  """One private step on (x, y, w): train_on_batch (static batch size) or, dynamic, fit on a
  dataset whose batch size is unknown to the trace (as fit's padded Poisson samples)."""
  if not dynamic:
    return helpers.one_step_update(model, x, y, sample_weight=w)
  spec = (tf.TensorSpec([None, 6], tf.float32), tf.TensorSpec([None], tf.int64),
          tf.TensorSpec([None], tf.float32))
  ds = python_source.python_dataset(lambda: iter([(x, y, w)]), spec)
  before = [v.numpy().copy() for v in model.trainable_variables]
  model.fit(ds.repeat(), steps_per_epoch=1, epochs=1, verbose=0)
  return [b - v.numpy() for b, v in zip(before, model.trainable_variables)]


# (clipping, max_physical_batch_size, dynamic batch axis, expected chunk layout). The default
# suite runs the 4 that cover every pair of levels of the three axes (a physical size only
# on the fast path); the (fast, None, static) case runs with -m slow.
_ALL = [("fast", None, False, (16, 8)), ("vectorized", None, False, (16, 8)),
        ("fast", 16, False, (16, 16, 16)), ("fast", None, True, (16, 8)),
        ("vectorized", None, True, (16, 8))]
_DEFAULT = _ALL[1:]


def test_the_default_cases_cover_every_pair_of_levels():
  for i, j in itertools.combinations(range(3), 2):
    assert {(c[i], c[j]) for c in _DEFAULT} == {(c[i], c[j]) for c in _ALL}, (i, j)


@pytest.mark.parametrize("clipping,physical,dynamic,layout", [
    pytest.param(*c, marks=() if c in _DEFAULT else pytest.mark.slow) for c in _ALL])
def test_padded_poisson_step_under_xla_is_exact(clipping, physical, dynamic, layout,
                                                 monkeypatch):
  """One model per layout takes three padded samples in a row (one trace): 5 real rows (no
  tail chunk runs), 21 (one) and 47 (all four); each step is checked against the reference
  at the weights it started from."""
  layouts = []
  layout_fn = chunking.chunk_layout
  monkeypatch.setattr(chunking, "chunk_layout", lambda *a, **k: layouts.append(
      layout_fn(*a, **k)) or layouts[-1])
  model = _model(clipping, physical)
  reals = (5, 21, 47)
  for real in reals:
    rng = np.random.RandomState(real)
    x = np.zeros((M, 6), "float32")
    y = np.zeros(M, "int64")
    x[:real], y[:real] = rng.randn(real, 6), rng.randint(0, 3, real)
    w = np.zeros(M, "float32")
    w[:real] = 1.0
    ref = helpers.reference_gradient(model, LOSS, x[:real], y[:real], clip=CLIP)
    got = _one_step(model, x, y, w, dynamic)
    # reference: the mean over the real rows; update: sum / E, times the pinned sum's shrink
    helpers.assert_close_up_to_the_shrink(got, [r * real / E for r in ref], rtol=2e-4,
                                          atol=2e-6, err_msg=str(real))
  assert int(model.optimizer.ledger.sample_count.numpy()) == len(reals)
  assert [tuple(t) for t in layouts] == [layout]   # traced once, with the skippable tail


def test_tail_chunks_run_up_to_the_last_real_record():
  step = _model("fast").optimizer.private_step
  runs = tf.Variable(0)
  layouts = []

  def chunk_fn(acc, chunk, mask):
    runs.assign_add(1)
    return [acc[0] + tf.reduce_sum(chunk * mask[:, None])], tf.reduce_sum(mask), chunk * 3.0

  @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([None, 2]),
                                                 tf.TensorSpec([None])])
  def total_dynamic(x, mask):
    layout = chunking.chunk_layout(step, 1, None)
    layouts.append(layout)
    return chunking.sum_over_chunks(chunk_fn, [tf.constant(0.0)], x, mask, layout)

  @tf.function(jit_compile=True)
  def total(x, mask):
    layout = chunking.chunk_layout(step, 1, x.shape[0])
    layouts.append(layout)
    return chunking.sum_over_chunks(chunk_fn, [tf.constant(0.0)], x, mask, layout)

  for fn in (total, total_dynamic):
    # M - 3: the last tail chunk is padded inside the loop; 16: no tail at all (q = 1)
    for rows in (M, M - 3, 16):
      x = tf.ones((rows, 2))
      # real: the last real record's index + 1 (a weight-0 record inside counts as padding)
      cases = ((0, 1), (5, 1), (16, 1), (17, 2), (24, 2), (25, 3), (rows, 1 + -(-(rows - 16) // 8)))
      for real, chunks in [c for c in cases if c[0] <= rows]:
        runs.assign(0)
        mask = np.zeros(rows, "float32")
        mask[:real] = 1.0
        if real > 2:
          mask[real - 2] = 0.0
        acc, loss, aux = fn(x, tf.constant(mask))
        assert float(acc[0]) == 2.0 * mask.sum() and float(loss) == mask.sum()
        ran = min(rows, 16 + 8 * (chunks - 1))   # rows whose aux was computed (the rest: 0)
        np.testing.assert_array_equal(aux.numpy(), np.r_[np.full((ran, 2), 3.0),
                                                         np.zeros((rows - ran, 2))])
        assert int(runs.numpy()) == chunks, (fn, rows, real, int(runs.numpy()))
  # a static batch of 16 rows is one chunk (None); every other trace has the padded tail
  assert all(tuple(t) == (16, 8) and isinstance(t, chunking.PaddedTail)
             for t in layouts if t is not None) and layouts.count(None) == 1


@pytest.mark.parametrize("expected,first,chunk", [(16, 16, 8), (60, 64, 8), (256, 256, 8),
                                                  (4096, 4096, 32)])
def test_padded_tail_layout_sizes(expected, first, chunk):
  step = _model("fast").optimizer.private_step
  step.expected_records.assign(float(expected))

  layouts = []

  @tf.function(jit_compile=True)
  def trace():
    layouts.append(chunking.chunk_layout(step, 1, None))
    return tf.constant(0)

  trace()
  assert layouts == [chunking.PaddedTail(first, chunk)]
